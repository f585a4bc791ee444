"""The on-disk formats mixmoe reads and writes, one module each (reader, writer, records).

==================  ===========================================  ==============================
module              format (docs/formats.md section)             read / write
==================  ===========================================  ==============================
``layer_log``       layer benchmark log (1)                      ``read_layer_log`` / ``*_line``
``model_log``       model benchmark log (2)                      ``read_model_log`` / ``*_line``
``cmd_trace``       per-rank CMD operation trace (3)             ``read_cmd_trace`` / ``write_cmd_file``
``profiler_table``  torch.profiler ``key_averages().table()`` (4)  ``read_profiler_table`` / ``format_profiler_table``
``chrome``          Chrome / Perfetto trace JSON (5)             ``read_chrome_trace`` / ``write_chrome_trace``
``traces``          CMD or Chrome files grouped by rank          ``read_traces``
``results``         benchmark JSONL with its environment         ``append_jsonl`` / ``environment``
==================  ===========================================  ==============================

Every module here is torch-free (a test imports each in a fresh interpreter and checks that
``torch`` stays out of ``sys.modules``) and imports nothing else from mixmoe but this package.
"""

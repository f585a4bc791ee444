"""The CMD line grammar (docs/formats.md section 3): edge cases and write -> parse round trip."""

from __future__ import annotations

import re
import string
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mixmoe.formats.cmd_trace import CmdOp, SubOp, format_cmd_line, parse_cmd_line, read_cmd_file

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "cmd_trace_pp4_ep2_rank0.txt"

FULL = (
    "rank:3:dp_allreduce(stage_id=1,batch_id=0,mg_state=finalize,duration=11.88,"
    "description=Regular DP sync (non-expert, fp32), lr=0.1 (warm,group_kind=dp,"
    "input__shape=[290013184],input__dtype=torch.float32,timestamp=3371168793.92,"
    "sub_operations=[])"
)


def test_description_with_commas_parentheses_and_key_value_pairs() -> None:
    op = parse_cmd_line(FULL)
    # "lr=0.1" is not an op key, and the unbalanced "(" must not swallow the following fields
    assert op.description == "Regular DP sync (non-expert, fp32), lr=0.1 (warm"
    assert op.group_kind == "dp"
    assert op.shape == (290013184,)
    assert op.dtype == "torch.float32"
    assert op.timestamp_ms == 3371168793.92
    assert op.start_ms == pytest.approx(3371168793.92 - 11.88)
    assert (op.rank, op.stage_id, op.batch_id, op.mg_state) == (3, 1, 0, "finalize")


def test_six_field_short_form() -> None:
    line = "rank:1:get_batch(stage_id=0,batch_id=7,mg_state=warmup,duration=None,description=None,group_kind=None)"
    op = parse_cmd_line(line)
    assert (op.name, op.batch_id, op.mg_state) == ("get_batch", 7, "warmup")
    assert op.duration_ms is None and op.timestamp_ms is None and op.shape is None
    assert op.sub_ops == () and not op.is_timed


def test_sub_operation_with_list_values_splits_at_depth_zero_only() -> None:
    sub = (
        "name=moe.dispatch,kind=comm,duration=0.25,timestamp=10.5,input__shape=[4, 16],"
        "input__dtype=torch.float32,in_splits=[1, 3],out_splits=[2, 0, 2],group=exp,"
        "comm_func=all_to_all,trace_src_func=f"
    )
    line = (
        "rank:0:forward_step(stage_id=0,batch_id=0,mg_state=steady,duration=1.5,description=None,"
        f"group_kind=None,input__shape=None,input__dtype=None,timestamp=11.0,sub_operations={[sub]!r})"
    )
    (s,) = parse_cmd_line(line).sub_ops
    assert s.in_splits == (1, 3) and s.out_splits == (2, 0, 2)
    assert s.shape == (4, 16) and s.group == "exp" and s.comm_func == "all_to_all"
    assert s.name == "moe.dispatch" and s.kind == "comm" and s.is_comm
    assert s.start_ms == pytest.approx(10.25)
    assert s.extra == (("trace_src_func", "f"),)


def test_unknown_op_name_and_unknown_keys_are_kept() -> None:
    line = (
        "rank:0:my_op.v2(stage_id=0,batch_id=1,mg_state=help,duration=2,description=None,"
        "group_kind=None,input__shape=None,input__dtype=None,timestamp=5,stream=7,sub_operations=[])"
    )
    op = parse_cmd_line(line)
    assert op.name == "my_op.v2" and op.extra == (("stream", "7"),)
    assert parse_cmd_line(format_cmd_line(op)) == op


@pytest.mark.parametrize(
    ("cut", "message"),
    [
        (FULL[:150], "closing ')' is missing"),  # cut inside the description
        (FULL[: FULL.index("fp32)") + 5], "lacks the fields"),  # cut right after a ')'
        (FULL.replace(",timestamp=3371168793.92", ""), "lacks ['timestamp']"),
    ],
)
def test_truncated_lines_raise_clear_errors(cut: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_cmd_line(cut)


def test_truncated_file_names_path_and_line(tmp_path) -> None:
    fixture_lines = FIXTURE.read_text().splitlines()
    path = tmp_path / "trace.txt"
    path.write_text("\n".join(fixture_lines[:10]) + "\n" + fixture_lines[10][:300] + "\n")
    with pytest.raises(ValueError) as err:
        read_cmd_file(path)
    assert f"{path}:11:" in str(err.value)


def test_noise_lines_are_skipped(tmp_path) -> None:
    fixture_lines = FIXTURE.read_text().splitlines()
    path = tmp_path / "trace.txt"
    path.write_text(
        "start\ncuda:3\n" + fixture_lines[0] + "\nrank: 2, nranks: 4\n" + fixture_lines[1]
    )
    ops = read_cmd_file(path)
    assert [op.name for op in ops] == ["get_batch", "forward_step"]
    assert [op.line_no for op in ops] == [3, 5]


_text = st.text(alphabet=string.ascii_letters + string.digits + " ,()[]=:_-.'", max_size=40)
_ints = st.lists(st.integers(0, 5000), max_size=4).map(tuple)
_ms = st.floats(0, 1e10, allow_nan=False).map(lambda x: round(x, 6))
_sub = st.builds(
    SubOp,
    name=st.sampled_from(["moe.gate", "moe.dispatch", None]),
    kind=st.sampled_from(["compute", "comm", None]),
    comm_func=st.sampled_from(["all_to_all", "allgather", None]),
    group=st.sampled_from(["exp", "dp", None]),
    shape=st.none() | _ints,
    dtype=st.sampled_from(["torch.bfloat16", None]),
    duration_ms=_ms,
    timestamp_ms=_ms,
    in_splits=st.none() | _ints,
    out_splits=st.none() | _ints,
)


@settings(max_examples=60, deadline=None)
@given(
    description=st.none() | _text.filter(lambda t: t.strip() not in ("", "None")),
    duration=_ms,
    timestamp=_ms,
    shape=st.none() | _ints,
    subs=st.lists(_sub, max_size=3),
)
def test_format_then_parse_round_trips(description, duration, timestamp, shape, subs) -> None:
    if description is not None:
        description = " ".join(description.split())  # the writer keeps descriptions on one line
    op = CmdOp(
        rank=1,
        name="forward_step",
        stage_id=2,
        batch_id=3,
        mg_state="steady",
        duration_ms=duration,
        description=description,
        group_kind="pp",
        shape=shape,
        dtype="torch.bfloat16",
        timestamp_ms=timestamp,
        sub_ops=tuple(subs),
    )
    assert parse_cmd_line(format_cmd_line(op)) == op

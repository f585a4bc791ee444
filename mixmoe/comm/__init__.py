"""Communication: the ONLY package that imports ``torch.distributed``.

``Communicator`` wraps a process group (gloo on CPU, NCCL on CUDA); ``LocalCommunicator`` is the
world-size-1 stand-in; ``autograd`` holds the differentiable all-to-alls; ``launch`` runs a
function on W local gloo processes (tests, benchmarks, the demo, ``--world-size``).
"""

from mixmoe.comm.communicator import (
    Communicator,
    LocalCommunicator,
    ProcessGroupCommunicator,
    Work,
)
from mixmoe.comm.process_group import (
    init_distributed,
    init_file_store,
    new_expert_groups,
    shutdown_distributed,
)

__all__ = [
    "Communicator",
    "LocalCommunicator",
    "ProcessGroupCommunicator",
    "Work",
    "init_distributed",
    "init_file_store",
    "new_expert_groups",
    "shutdown_distributed",
]

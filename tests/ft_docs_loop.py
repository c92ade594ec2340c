"""docs/fault_tolerance.md's plain training loop, run as written as one replica group of the
fault-tolerance tests (tests/sync/fault_tolerance/test_fault_tolerance.py), with a recorder around it: at each training
forward, the step the synchroniser stands at (after its quorum: the step the forward belongs to)
and whether the model's input is the loop's ``batch`` of that step. Writes the record and the final
parameters to ``OUT`` (the first argument); with a folder as the second, first waits there for
``GROUPS`` groups (each leaves a file), so that the groups start together, as a scheduler starts
them. The lighthouse and the group come from the environment, as the docs' loop reads them."""

import os
import sys
import time
from pathlib import Path

import torch
from doc_blocks import code_blocks

from gc_strategy import FaultTolerantSynchronizer

PAGE = Path(__file__).resolve().parents[1] / "docs" / "fault_tolerance.md"


def main() -> None:
    code = next(code for language, code in code_blocks(PAGE) if language == "python" and "sync.start_step()" in code)
    namespace = {"__name__": "__main__"}
    record = []
    build = FaultTolerantSynchronizer.__init__

    def recording(sync: FaultTolerantSynchronizer, module: torch.nn.Module, *args: object, **kwargs: object) -> None:
        build(sync, module, *args, **kwargs)

        def read(_: torch.nn.Module, inputs: tuple) -> None:
            step = sync.committed_steps
            own = torch.equal(inputs[0], namespace["batch"](step)[0])
            record.append({"step": step, "own_batch": own, "participants": sync.participants})
            print(f"step {step}", flush=True)

        module.register_forward_pre_hook(read)

    FaultTolerantSynchronizer.__init__ = recording
    if len(sys.argv) > 2:
        wait_for_groups(Path(sys.argv[2]), int(os.environ["GROUPS"]))
    exec(compile(code, str(PAGE), "exec"), namespace)
    params = {name: p.detach().clone() for name, p in namespace["model"].named_parameters()}
    torch.save({"record": record, "params": params, "committed_steps": namespace["sync"].committed_steps}, sys.argv[1])


def wait_for_groups(folder: Path, groups: int, timeout: float = 120) -> None:
    (folder / f"ready-{os.environ['REPLICA_GROUP_ID']}").touch()
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("ready-*"))) < groups:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every one of {groups} groups started within {timeout} s")
        time.sleep(0.05)


if __name__ == "__main__":
    main()

"""The demo launcher: its report of a failed replica group (the end of its log, where it is read)
and the digest of a group's parameters."""

import hashlib

import torch

from app.replica_groups import log_tail, parameter_digest


def test_a_failed_groups_report_ends_with_the_last_lines_of_its_log(tmp_path):
    log = tmp_path / "group1.log"
    log.write_text("".join(f"line {i}   \n" for i in range(100)) + "Traceback: RuntimeError: boom\n")
    tail = log_tail(log, lines=3).splitlines()
    assert tail == ["  | line 98", "  | line 99", "  | Traceback: RuntimeError: boom"]
    assert log_tail(tmp_path / "missing.log") == "  | (no log)"


def test_the_parameter_digest_hashes_names_and_bytes_and_leaves_each_storage_resizable():
    """FSDP2 frees its gathered parameters by resizing their storage, which ``numpy()`` forbids for
    good: the digest reads copies."""
    weight, bias = torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, -1.0])
    expected = hashlib.sha256()
    for name, tensor in (("weight", weight), ("bias", bias)):
        expected.update(name.encode())
        expected.update(bytes(tensor.untyped_storage()))
    assert parameter_digest({"weight": weight, "bias": bias}) == expected.hexdigest()
    assert weight.untyped_storage().resizable() and bias.untyped_storage().resizable()

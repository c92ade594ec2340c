"""The demo launcher's report of a failed replica group: the end of its log, where it is read."""

from app.replica_groups import log_tail


def test_a_failed_groups_report_ends_with_the_last_lines_of_its_log(tmp_path):
    log = tmp_path / "group1.log"
    log.write_text("".join(f"line {i}   \n" for i in range(100)) + "Traceback: RuntimeError: boom\n")
    tail = log_tail(log, lines=3).splitlines()
    assert tail == ["  | line 98", "  | line 99", "  | Traceback: RuntimeError: boom"]
    assert log_tail(tmp_path / "missing.log") == "  | (no log)"

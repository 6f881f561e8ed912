import pytest

from tests.notebook_runner import REPO, run_notebook


@pytest.mark.slow
def test_replay_notebook_runs(tmp_path):
    proc = run_notebook(
        REPO / "notebooks" / "replay.ipynb",
        timeout_s=600,
        env={"RESIHP_QUICK": "1", "PYTHONPATH": str(REPO)},
        cwd=tmp_path,
    )
    assert "resihp" in proc.stdout and "checkpoint-restart" in proc.stdout
    assert (tmp_path / "out" / "replay-failstop-7b-256.png").stat().st_size > 10_000

import io

from resihp.progress import PlainProgress


def test_plain_progress_writes_every_few_percent_and_at_the_end():
    now = [0.0]
    out = io.StringIO()
    advance = PlainProgress("profiling", 100, out, every_pct=25, every_s=30, clock=lambda: now[0])
    for n in range(1, 101):
        now[0] = n * 0.1
        advance(n)
    lines = out.getvalue().splitlines()
    assert lines[0] == "profiling: 25/100 (25%), 0m02s elapsed, ETA 0m08s"
    assert [line.split(":")[1].split()[0] for line in lines] == [
        "25/100",
        "50/100",
        "75/100",
        "100/100",
    ]
    assert "ETA" not in lines[-1]


def test_plain_progress_writes_when_time_passes_without_percent():
    now = [0.0]
    out = io.StringIO()
    advance = PlainProgress("run", 1000, out, every_pct=50, every_s=30, clock=lambda: now[0])
    now[0] = 31.0
    advance(10)  # 1%: only the 30 s rule speaks
    assert out.getvalue() == "run: 10/1000 (1%), 0m31s elapsed, ETA 51m09s\n"
    advance(11)
    assert out.getvalue().count("\n") == 1

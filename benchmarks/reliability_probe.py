"""Reliability probe: the faults and bad inputs of issue 70, each a real process run with the fault
and a verdict. Prints JSON (and writes it with ``--out``): every case, and the counts by severity of
the findings found (``fail``: the behaviour the issue found) and fixed (``pass``).

    python benchmarks/reliability_probe.py --out benchmarks/results/reliability-probe.json
    python benchmarks/reliability_probe.py --quick            # one bad input per kind, shorter runs

Each case starts ``resihp`` (or the keeper, a store, a bystander) as its own processes and acts on
them by PID: SIGKILL, SIGSTOP, a file system filled, a forged store record. A case that cannot run
here (a tmpfs of its own needs root) is ``skipped``, with the reason. ``pass`` is the fixed
behaviour: refused in one line, replaced, no signal, reclaimed, bounded; ``fail`` is what the
issue found (code run from a checkpoint, a stall, a signal to a bystander, a silent ``done``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
SMALL = [
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "2",
    "--ffn-hidden",
    "128",
    "--vocab",
    "256",
    "--global-tokens",
    "1024",
    "--budget",
    "256",
    "--max-len",
    "256",
    "--no-live",
    "--json",
    "--heartbeat-timeout",
    "3",
    "--timeout",
    "60",
    "--pp",
    "1",
]
SEVERITIES = ("critical", "high", "medium")


class Skip(Exception):
    """A case that cannot run on this machine (the reason)."""


# --- processes and files --------------------------------------------------------------------------
def cli(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """``resihp ARGS`` to its end (a run past ``timeout`` is killed: returncode None)."""
    try:
        return subprocess.run(
            [sys.executable, "-m", "resihp.cli", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or ENV,
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, None, exc.stdout or "", exc.stderr or "")


def start(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "resihp.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or ENV,
    )


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    """The process's status and output; killed (status None) past ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return None, out, err


def one_line(rc: int | None, err: str, code: int = 2) -> str | None:
    """Why ``err`` is not a one-line refusal with exit ``code`` (None: it is one)."""
    lines = err.strip().splitlines()
    if rc is None:
        return "no answer within the case's bound (killed)"
    if rc != code:
        return f"exit {rc}, expected {code}: {err.strip()[-300:]}"
    if "Traceback" in err or len(lines) != 1:
        return f"{len(lines)} lines on stderr (a traceback: {'Traceback' in err})"
    return None


def newest_step(out: Path) -> int:
    steps = [-1]
    with contextlib.suppress(OSError):
        for line in (out / "ops.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError, TypeError):
                steps.append(int(json.loads(line).get("step", -1)))
    return max(steps)


def wait_until(what: Callable[[], bool], timeout_s: float, proc: subprocess.Popen | None) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if what():
            return True
        if proc is not None and proc.poll() is not None:
            return False
        time.sleep(0.02)
    return False


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of its own at ``where`` (root only, else :class:`Skip`)."""
    where.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        raise Skip("needs root to mount a small tmpfs of its own")
    if (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
        ).returncode
        != 0
    ):
        raise Skip("mount -t tmpfs refused here (a container without CAP_SYS_ADMIN)")
    try:
        yield where
    finally:
        for _ in range(100):
            if subprocess.run(["umount", str(where)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)


def fill(directory: Path) -> None:
    """Write into ``directory`` until its file system is full."""
    with contextlib.suppress(OSError), open(directory / ".filler", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def workers(out: Path) -> dict[int, int]:
    """rank -> PID of the run's workers still running (``OUT/logs/processes.jsonl``)."""
    from resihp.train.lifecycle import start_time
    from resihp.train.worker import processes_file

    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for line in processes_file(out).read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                e = json.loads(line)
                if start_time(e["pid"]) == e.get("ticks") and alive(e["pid"]):
                    found[e["node"] * e["local_world_size"] + e["local_rank"]] = e["pid"]
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the cases ------------------------------------------------------------------------------------
class Probe:
    def __init__(self, root: Path, quick: bool) -> None:
        self.root, self.quick = root, quick
        self._ckpt_run: Path | None = None

    def dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def ckpt_run(self) -> Path:
        """A real run's folder with checkpoints (4 steps, one after step 1 and one after step 3)."""
        if self._ckpt_run is None:
            out = self.dir("base") / "run"
            proc = cli(
                "run", *SMALL, "--dp", "1", "--steps", "4", "--ckpt-every", "2", "-o", str(out)
            )
            if proc.returncode != 0:
                raise RuntimeError(f"the base run failed: {proc.stderr[-500:]}")
            self._ckpt_run = out
        return self._ckpt_run

    def crafted(self, name: str) -> tuple[Path, Path]:
        """A copy of the base run whose newest checkpoint holds an optimizer step counter as a
        pickled payload (a DCP bytes item) that creates a marker file, its manifest rewritten."""
        import torch.distributed.checkpoint as dcp

        from resihp.ckpt.integrity import read_manifest, write_manifest
        from resihp.ckpt.single import single_process
        from resihp.ckpt.universal import read_full

        out = self.root / name / "crafted"
        shutil.copytree(self.ckpt_run(), out)
        ckpt = max((out / "ckpt").glob("step*"), key=lambda p: int(p.name[4:]))
        marker = self.root / name / "pwned"
        state = read_full(ckpt)
        key = next(k for k in sorted(state) if k.endswith(".step"))
        state[key] = _Payload(str(marker))
        identity = {k: v for k, v in read_manifest(ckpt).items() if k not in ("format", "files")}
        meta = (ckpt / "meta.json").read_text()
        shutil.rmtree(ckpt)
        with single_process():
            dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
        (ckpt / "meta.json").write_text(meta)
        write_manifest(ckpt, identity)
        return ckpt, marker

    # finding 1 (critical): a checkpoint's bytes item was unpickled: code ran
    def pickle_resume(self) -> tuple[bool, str]:
        ckpt, marker = self.crafted("pickle-resume")
        proc = cli(
            "run",
            *SMALL,
            "--dp",
            "1",
            "--steps",
            "6",
            "--resume",
            str(ckpt),
            "-o",
            str(self.dir("pickle-resume") / "again"),
        )
        if marker.exists():
            return False, "the payload ran (marker file created)"
        why = one_line(proc.returncode, proc.stderr)
        return why is None, why or proc.stderr.strip()

    def pickle_convert_inspect(self) -> tuple[bool, str]:
        ckpt, marker = self.crafted("pickle-convert")
        said = []
        for args in (
            ("convert", str(ckpt), str(self.root / "pickle-convert" / "m.pt")),
            ("inspect", str(ckpt)),
        ):
            proc = cli("ckpt", *args)
            why = one_line(proc.returncode, proc.stderr)
            if why is not None or marker.exists():
                return False, f"ckpt {args[0]}: {why or 'the payload ran'}"
            said.append(f"{args[0]}: {proc.stderr.strip()[:160]}")
        return True, "; ".join(said)

    # finding 2 (critical): a forged heartbeat naming a bystander PID got it signalled
    def forged_heartbeat(self) -> tuple[bool, str]:
        from resihp.detect.heartbeat import connect_store, node_key, rank_key
        from resihp.train import controlplane as cp

        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        port = free_port()
        out = self.dir("forged") / "run"
        proc = start(
            "run",
            *SMALL,
            "--dp",
            "2",
            "--recovery",
            "none",
            "--steps",
            "100000",
            "-o",
            str(out),
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
        )
        forged_n = 0
        try:
            store = connect_store("127.0.0.1", port, timeout_s=60)
            if not wait_until(lambda: store.check([cp.JOB_KEY]), 60, proc):
                return False, "the job never announced itself"
            job = json.loads(store.get(cp.JOB_KEY))["job_id"]
            hb = cp.heartbeat_prefix(job)
            if not wait_until(lambda: store.check([node_key(hb, 0)]), 60, proc):
                return False, "node 0 never beat"
            beat = {
                "c": 10**6,
                "pid": bystander.pid,
                "step": 1,
                "phase": "train",
                "ops": 1,
                "wait": "",
            }
            hung = {
                "seen": True,
                "silent_s": 0.0,
                "stalled_s": 1000.0,
                "step": 1,
                "phase": "train",
                "ops": 1,
                "wait": "",
                "pid": bystander.pid,
                "exited": False,
                "stopped": False,
                "alive": True,
            }
            forged = {"beat": 10**6, "ranks": {"1": hung}}
            until = time.monotonic() + (4 if self.quick else 8)
            while proc.poll() is None and time.monotonic() < until:
                try:
                    store.set(rank_key(hb, 0, 1), json.dumps(beat))
                    forged["beat"] += 1
                    store.set(node_key(hb, 0), json.dumps(forged))
                except RuntimeError:  # the job ended, and its store with it
                    break
                forged_n += 1
                time.sleep(0.02)
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
            rc, _, err = finish(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
        ok = bystander.poll() is None
        bystander.kill()
        bystander.wait()
        if not ok:
            return False, f"the bystander (PID {bystander.pid}) was ended by a signal"
        if f"process {bystander.pid}" in err:
            return False, "the launcher acted on the bystander's PID"
        return True, f"{forged_n} forged records; bystander untouched; job exit {rc}"

    def used_run_folder(self) -> tuple[bool, str]:
        out = self.dir("used") / "run"
        holder = start("run", *SMALL, "--dp", "1", "--steps", "100000", "-o", str(out))
        try:
            if not wait_until(lambda: newest_step(out) >= 0, 120, holder):
                return False, "the first job did not train"
            proc = cli("run", *SMALL, "--dp", "1", "--steps", "2", "-o", str(out), timeout=120)
        finally:
            holder.send_signal(signal.SIGINT)
            finish(holder, 120)
        why = one_line(proc.returncode, proc.stderr)
        return why is None and "in use" in proc.stderr, why or proc.stderr.strip()

    # finding 3 (high): a SIGSTOPped keeper stalled every snapshot until its 60 s timeout
    def stopped_keeper(self) -> tuple[bool, str]:
        out, shm = self.dir("stopped-keeper") / "run", self.dir("stopped-keeper") / "shm"
        proc = start(
            "run",
            *SMALL,
            "--dp",
            "2",
            "--steps",
            "10",
            "--snapshot-every",
            "1",
            "--ckpt-every",
            "2",
            "-o",
            str(out),
            env={**ENV, "RESIHP_SHM": str(shm)},
        )
        try:
            wait_until(lambda: (out / "ckpt" / "persist.jsonl").exists(), 120, proc)
            pids = [int(p.read_text()) for p in shm.glob("*/keeper.pid")]
            if not pids:
                return False, "no keeper found"
            t0 = time.monotonic()
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)

            def replaced() -> bool:
                with contextlib.suppress(OSError, ValueError):
                    now = {int(p.read_text()) for p in shm.glob("*/keeper.pid")}
                    return bool(now) and not now & set(pids)
                return False

            ok = wait_until(replaced, 30, proc)
            took = time.monotonic() - t0
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            rc, stdout, err = finish(proc, 240)
        finally:
            if proc.poll() is None:
                proc.kill()
        if not ok or rc != 0:
            return False, f"replaced: {ok}; exit {rc}: {err.strip()[-300:]}"
        return True, f"keeper {pids} replaced {took:.1f} s after SIGSTOP; job done (exit 0)"

    # finding 4 (high): the disk filling while the keeper persists ended in "done"
    def disk_full_persist(self) -> tuple[bool, str]:
        out = self.dir("disk-full") / "run"
        with tmpfs(out / "ckpt", "1600k"):
            proc = cli(
                "run",
                *SMALL,
                "--dp",
                "1",
                "--steps",
                "8",
                "--snapshot-every",
                "1",
                "--ckpt-every",
                "2",
                "-o",
                str(out),
                timeout=240,
                env={**ENV, "RESIHP_SHM": str(self.dir("disk-full") / "shm")},
            )
            state = json.loads((out / "run.json").read_text()).get("state")
        said = [x for x in proc.stderr.splitlines() if "not written" in x]
        if proc.returncode in (0, None) or state == "done" or len(said) != 1:
            return False, f"exit {proc.returncode}, state {state}: {proc.stderr.strip()[-300:]}"
        return "Traceback" not in proc.stderr, said[0]

    # finding 5 (high): launcher and keeper SIGKILLed left their tier: the next job was refused
    def left_tier_reclaimed(self) -> tuple[bool, str]:
        from resihp.ckpt.keeper import ensure_keeper, keeper_pid

        shm = self.dir("left-tier") / "shm"
        owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        tier = shm / "resihp-20260101-000000-dead00-n0"
        keeper = ensure_keeper(tier, owner.pid)
        (tier / "rank0.A.bin").write_bytes(b"\0" * (1 << 20))
        wait_until(lambda: (tier / "owner.json").exists(), 20, None)
        for pid in (owner.pid, keeper):  # together: neither can clean up
            os.kill(pid, signal.SIGKILL)
        owner.wait()
        wait_until(lambda: keeper_pid(tier) is None, 20, None)
        proc = cli(
            "run",
            *SMALL,
            "--dp",
            "1",
            "--steps",
            "3",
            "--snapshot-every",
            "1",
            "-o",
            str(self.dir("left-tier") / "run"),
            timeout=240,
            env={**ENV, "RESIHP_SHM": str(shm)},
        )
        if proc.returncode != 0 or tier.exists():
            return False, f"exit {proc.returncode}; tier left: {tier.exists()}"
        said = [x for x in proc.stderr.splitlines() if f"removed the memory tier {tier}" in x]
        return len(said) == 1, said[0] if said else proc.stderr.strip()[-300:]

    # finding 6 (high): a killed warm-agent server (forkserver) lost every replica
    def forkserver_killed(self) -> tuple[bool, str]:
        out = self.dir("forkserver") / "run"
        steps = 16 if self.quick else 30
        proc = start(
            "run",
            *SMALL,
            "--dp",
            "2",
            "--steps",
            str(steps),
            "--recovery",
            "replica",
            "-o",
            str(out),
        )
        try:
            if not wait_until(lambda: newest_step(out) >= 1, 120, proc):
                return False, "the job did not train a step"
            servers = [
                p for p in children(proc.pid) if b"multiprocessing.forkserver" in _cmdline(p)
            ]
            if not servers:
                raise Skip("this run started its agents cold (no warm-agent server)")
            os.kill(servers[0], signal.SIGKILL)
            rc, _, err = finish(proc, 300)
        finally:
            if proc.poll() is None:
                proc.kill()
        summary = _read(out / "summary.json")
        losses = len(summary.get("losses") or [])
        if rc != 0 or losses != steps:
            return False, f"exit {rc}, {losses} of {steps} steps: {err.strip()[-300:]}"
        return True, f"server {servers[0]} SIGKILLed at step 1+; {losses} steps trained, exit 0"

    # the memory tier's file system filling mid-run: a 60 s stall, then "workers exited"
    def tier_full(self) -> tuple[bool, str]:
        out = self.dir("tier-full") / "run"
        with tmpfs(self.dir("tier-full") / "shm", "16m") as shm:
            proc = start(
                "run",
                *SMALL,
                "--dp",
                "1",
                "--steps",
                "24",
                "--snapshot-every",
                "1",
                "-o",
                str(out),
                env={**ENV, "RESIHP_SHM": str(shm)},
            )
            filled = wait_until(lambda: newest_step(out) >= 4, 120, proc)
            if filled:
                fill(shm)
            rc, _, err = finish(proc, 240)
        notes = [x for x in err.splitlines() if x.startswith("resihp: note:")]
        if not filled or rc != 0 or len(notes) != 1:
            return False, f"filled: {filled}; exit {rc}: {err.strip()[-300:]}"
        return True, notes[0]

    # two replicas failing at once: one line, bounded
    def two_replicas_fail(self) -> tuple[bool, str]:
        out = self.dir("two-replicas") / "run"
        proc = start(
            "run", *SMALL, "--dp", "2", "--steps", "100000", "--recovery", "replica", "-o", str(out)
        )
        try:
            if not wait_until(lambda: newest_step(out) >= 2 and len(workers(out)) == 2, 120, proc):
                return False, "the job did not train"
            for pid in workers(out).values():
                os.kill(pid, signal.SIGKILL)
            rc, _, err = finish(proc, 120)
        finally:
            if proc.poll() is None:
                proc.kill()
        said = [x for x in err.splitlines() if x.startswith("resihp:")]
        ok = rc not in (0, None) and "Traceback" not in err and len(said) == 1
        return ok, said[0] if said else f"exit {rc}: {err.strip()[-300:]}"

    # bad inputs, each a one-line refusal within a bound
    def follow_not_a_store(self) -> tuple[bool, str]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        conns: list[socket.socket] = []
        threading.Thread(target=lambda: _accept(sock, conns), daemon=True).start()
        try:
            endpoint = f"127.0.0.1:{sock.getsockname()[1]}"
            proc = cli(
                "follow", "--store", endpoint, "--start-timeout", "3", "--nice", "0", timeout=40
            )
        finally:
            sock.close()
            for c in conns:
                c.close()
        why = one_line(proc.returncode, proc.stderr)
        return why is None, why or proc.stderr.strip()

    def huge_lengths(self) -> tuple[bool, str]:
        path = self.dir("lengths") / "big.txt"
        with path.open("w") as f:
            for _ in range(3 if self.quick else 10):
                f.write("512\n" * 1_000_000)
        proc = cli(
            "profile",
            "--lengths",
            str(path),
            "--budget",
            "1024",
            "-o",
            str(self.dir("lengths") / "p.parquet"),
            timeout=90,
        )
        why = one_line(proc.returncode, proc.stderr)
        return why is None, why or proc.stderr.strip()

    def bad_inputs(self) -> dict[str, Callable[[], tuple[bool, str]]]:
        """One case per bad YAML, JSON and flag (``--quick``: the first of each)."""
        d = self.dir("bad")
        (d / "tabs.yaml").write_text("nodes:\n\t- gpus: 8\n")
        (d / "alias.yaml").write_text(
            'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
            + "".join(
                f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi")
            )
        )
        (d / "twice.yaml").write_text("name: a\nname: b\n")
        (d / "plan.json").write_text('{"layout": [1, 2')
        (d / "plan-nan.json").write_text('{"layout": NaN}')
        model = "traces/models/cpu-small.yaml"
        cluster = "traces/clusters/cpu-4.yaml"
        cases = {
            "yaml": [
                ("plan", "--cluster", str(d / "tabs.yaml"), "--model", model),
                ("plan", "--cluster", str(d / "alias.yaml"), "--model", model),
                ("replay", str(d / "twice.yaml")),
            ],
            "json": [
                ("plan", "--cluster", cluster, "--model", model, "--current", str(d / "plan.json")),
                (
                    "plan",
                    "--cluster",
                    cluster,
                    "--model",
                    model,
                    "--current",
                    str(d / "plan-nan.json"),
                ),
            ],
            "flags": [
                ("run", "--dp", "-1", "-o", str(d / "r1")),
                ("run", "--inject", "garbage", "-o", str(d / "r2")),
                ("run", "--steps", "abc", "-o", str(d / "r3")),
                ("run", "--lr", "nan", "-o", str(d / "r4")),
            ],
        }
        found = {}
        for kind, argsets in cases.items():
            for i, args in enumerate(argsets[:1] if self.quick else argsets):
                found[f"bad {kind} {i + 1}: resihp {' '.join(a.split('/')[-1] for a in args)}"] = (
                    lambda args=args: self._refused(args)
                )
        return found

    def _refused(self, args: tuple[str, ...]) -> tuple[bool, str]:
        proc = cli(*args, timeout=60)
        why = one_line(proc.returncode, proc.stderr)
        return why is None, why or proc.stderr.strip()


class _Payload:
    """Unpickled, it runs a shell command (creates the marker file)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _accept(sock: socket.socket, conns: list) -> None:
    while True:
        try:
            conns.append(sock.accept()[0])
        except OSError:
            return


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# (name, finding, severity, method): the findings first, then the bad inputs per entry point
CASES = [
    ("resume from a checkpoint with a pickle payload", 1, "critical", "pickle_resume"),
    ("ckpt convert/inspect of it", 1, "critical", "pickle_convert_inspect"),
    ("forged heartbeat naming a bystander PID", 2, "critical", "forged_heartbeat"),
    ("a run into a used run folder", None, "medium", "used_run_folder"),
    ("SIGSTOPped keeper", 3, "high", "stopped_keeper"),
    ("disk full while the keeper persists", 4, "high", "disk_full_persist"),
    ("launcher and keeper SIGKILLed, then a new job", 5, "high", "left_tier_reclaimed"),
    ("warm-agent server (forkserver) killed", 6, "high", "forkserver_killed"),
    ("/dev/shm filling mid-run", None, "high", "tier_full"),
    ("two replicas failing at once", None, "medium", "two_replicas_fail"),
    ("follow --store on a port that is not a store", None, "medium", "follow_not_a_store"),
    ("profile with a huge lengths file", None, "medium", "huge_lengths"),
]


def run_case(name: str, fn: Callable[[], tuple[bool, str]]) -> dict:
    t0 = time.monotonic()
    try:
        ok, detail = fn()
        verdict = "pass" if ok else "fail"
    except Skip as why:
        verdict, detail = "skipped", str(why)
    except Exception as exc:  # a case that could not be run is said, not counted as either
        verdict, detail = "error", f"{type(exc).__name__}: {exc}"
    return {
        "case": name,
        "verdict": verdict,
        "detail": " ".join(str(detail).split())[:400],
        "seconds": round(time.monotonic() - t0, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one bad input per kind, short runs")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--only", default="", help="comma-separated method names to run")
    args = parser.parse_args()
    only = {s for s in args.only.split(",") if s}
    root = Path(tempfile.mkdtemp(prefix="resihp-probe-"))
    probe = Probe(root, args.quick)
    results = []
    try:
        for name, finding, severity, method in CASES:
            if only and method not in only:
                continue
            row = run_case(name, getattr(probe, method))
            results.append({**row, "finding": finding, "severity": severity, "method": method})
            print(json.dumps(results[-1]), file=sys.stderr, flush=True)
        if not only or "bad_inputs" in only:
            for name, fn in probe.bad_inputs().items():
                row = run_case(name, fn)
                results.append(
                    {**row, "finding": None, "severity": "medium", "method": "bad_input"}
                )
                print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    counts = {
        sev: {
            "cases": sum(r["severity"] == sev for r in results),
            "found": sum(r["severity"] == sev and r["verdict"] == "fail" for r in results),
            "fixed": sum(r["severity"] == sev and r["verdict"] == "pass" for r in results),
            "skipped": sum(
                r["severity"] == sev and r["verdict"] in ("skipped", "error") for r in results
            ),
        }
        for sev in SEVERITIES
    }
    report = {
        "benchmark": "reliability_probe",
        "quick": args.quick,
        "root": os.geteuid() == 0,
        "cpu_cores": os.cpu_count(),
        "counts": counts,
        "cases": results,
    }
    text = json.dumps(report, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""Nothing lost, nothing silently wrong (issue 16): outputs, text, limits, sizes, Ctrl-C."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from million_app import generation

CALIB = ("--text", "builtin:calib", "--tokens", "512", "--window", "256", "--nbits", "4",
         "--iters", "2")


def _leftovers(d) -> list[str]:
    return sorted(n for n in os.listdir(d) if n.endswith(".tmp") or ".million-jax-probe" in n)


def test_calibrate_refuses_to_overwrite_without_force_and_keeps_mode(error_line, cli, tiny_dir, tmp_path):
    out = tmp_path / "books.safetensors"
    out.write_bytes(b"precious")
    os.chmod(out, 0o640)
    line = error_line(cli("calibrate", "--model", tiny_dir, *CALIB, "--out", out))
    assert "already exists" in line and "--force" in line
    assert out.read_bytes() == b"precious"
    res = cli("calibrate", "--model", tiny_dir, *CALIB, "--out", out, "--force", "--quiet")
    assert res.rc == 0, res.err
    assert out.read_bytes()[:8] != b"precious"[:8] and out.stat().st_size > 1000
    assert oct(out.stat().st_mode & 0o777) == oct(0o640)
    assert _leftovers(tmp_path) == []


def test_new_codebook_file_gets_umask_mode(cli, tiny_dir, tmp_path):
    out = tmp_path / "new.safetensors"
    assert cli("calibrate", "--model", tiny_dir, *CALIB, "--out", out, "--quiet").rc == 0
    mask = os.umask(0)
    os.umask(mask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~mask


@pytest.mark.parametrize("where", ["dir", "missing", "proc"])
def test_unwritable_out_is_one_line_before_any_work(error_line, cli, tiny_dir, tmp_path, where):
    target = {"dir": tmp_path, "missing": tmp_path / "no" / "b.safetensors",
              "proc": "/proc/million-jax-test.safetensors"}[where]
    # not --quiet: a status line would show if calibration had started
    line = error_line(cli("calibrate", "--model", tiny_dir, *CALIB, "--out", target))
    assert "--out" in line
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("target", ["/proc/x.json", "DIR"])
def test_eval_json_unwritable_is_one_line_before_evaluating(error_line, cli, tiny_dir, tmp_path, target):
    target = tmp_path if target == "DIR" else target
    line = error_line(cli("eval", "--model", tiny_dir, "--text", "builtin:eval",
                              "--max-tokens", 256, "--window", 128, "--json", target))
    assert "--json" in line


def test_binary_or_non_utf8_text_refused_unless_asked(error_line, cli, tiny_dir, tmp_path):
    binary = tmp_path / "prog.bin"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 8)
    assert "binary" in error_line(cli("eval", "--model", tiny_dir, "--text", binary))
    latin = tmp_path / "latin1.txt"
    latin.write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e, na\xefve. ".encode("latin-1") * 200)
    line = error_line(cli("eval", "--model", tiny_dir, "--text", latin, "--window", 128))
    assert "not utf-8 text" in line and "--encoding" in line
    line = error_line(cli("calibrate", "--model", tiny_dir, "--text", latin, "--out",
                              tmp_path / "b.safetensors"))
    assert "--text" in line
    ok = cli("eval", "--model", tiny_dir, "--text", latin, "--encoding", "latin-1",
             "--window", 128, "--max-tokens", 256, "--quiet")
    assert ok.rc == 0 and "ppl" in ok.out, ok.err
    ok = cli("eval", "--model", tiny_dir, "--text", binary, "--errors", "replace",
             "--window", 128, "--max-tokens", 256, "--quiet")
    assert ok.rc == 0, ok.err
    assert "unknown text encoding" in error_line(
        cli("eval", "--model", tiny_dir, "--text", latin, "--encoding", "klingon"))


def test_window_beyond_max_position_embeddings_refused(error_line, cli, tiny_dir, codebooks, tmp_path):
    # the tiny model has max_position_embeddings 512
    for argv in (("eval", "--text", "builtin:eval", "--window", 1024),
                 ("eval", "--text", "builtin:eval", "--window", 1024, "--cache", "pq",
                  "--codebooks", codebooks),
                 ("calibrate", "--text", "builtin:calib", "--window", 600, "--out", tmp_path / "b.st"),
                 ("demo", "--window", 1024)):
        line = error_line(cli(argv[0], "--model", tiny_dir, *argv[1:]))
        assert "max_position_embeddings 512" in line, line


def test_generate_sized_up_front(error_line, cli, tiny_dir, monkeypatch):
    res = cli("generate", "--model", tiny_dir, "--prompt", "Hello", "--max-new-tokens", 100000000)
    assert "max_position_embeddings 512" in error_line(res)
    assert res.out == ""                      # not even the prompt was echoed
    monkeypatch.setattr(generation, "available_memory", lambda: 1000)
    res = cli("generate", "--model", tiny_dir, "--prompt", "Hello", "--max-new-tokens", 400)
    assert "free here" in error_line(res)


def test_generate_explains_why_a_short_pq_cache_is_larger(cli, tiny_dir, codebooks):
    res = cli("generate", "--model", tiny_dir, "--prompt", "Hi", "--max-new-tokens", 3,
              "--cache", "pq", "--codebooks", codebooks, "--quiet")
    assert res.rc == 0, res.err
    assert "exact window" in res.out and "smaller than dense from about" in res.out
    res = cli("generate", "--model", tiny_dir, "--prompt", "Hi", "--max-new-tokens", 3, "--quiet")
    assert "exact window" not in res.out


def test_ctrl_c_during_kmeans_stops_cleanly(tiny_dir, tmp_path):
    """SIGINT to the real ``python -m million_app`` during a k-means that would run for
    minutes: exit status 130, one 'interrupted' line, the old --out intact, no partial file.

    The 60 s bound only catches a process that waits for the k-means (or hangs).
    """
    out = tmp_path / "books.safetensors"
    out.write_bytes(b"old codebooks")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.getcwd()] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "million_app", "calibrate", "--model", tiny_dir,
         "--text", "builtin:calib", "--tokens", "4096", "--window", "256", "--nbits", "8",
         "--iters", "100000", "--out", str(out), "--force"],
        stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        # a test run started in the background (``cmd &`` without job control) has SIGINT
        # ignored, and a child inherits that: give it the disposition of a terminal session
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    deadline = time.monotonic() + 240
    for line in proc.stderr:                  # wait until the k-means has started
        seen.append(line)
        if line.startswith("k-means") or time.monotonic() > deadline:
            break
    assert any(s.startswith("k-means") for s in seen), "".join(seen)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("calibrate did not stop within 60 s of Ctrl-C")
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err, err
    assert out.read_bytes() == b"old codebooks"
    assert _leftovers(tmp_path) == []


def test_ctrl_c_returns_while_the_work_is_stuck_in_c(cli, monkeypatch):
    """Ctrl-C while the command sits in a C call that ignores signals (like an XLA compile):
    ``main`` returns 130 without waiting for that call. The call blocks on a mutex this test
    holds and releases only after ``main`` returned (or after 60 s, when it waits wrongly)."""
    import ctypes
    import threading

    from million_app.commands import REGISTRY

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach only the main thread")
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)               # zeroed = PTHREAD_MUTEX_INITIALIZER
    held, release, finished = threading.Event(), threading.Event(), threading.Event()

    def owner():
        libc.pthread_mutex_lock(mutex)
        held.set()
        release.wait(60)
        libc.pthread_mutex_unlock(mutex)

    def stuck_command(args):
        libc.pthread_mutex_lock(mutex)                    # blocks in C, signals or not
        libc.pthread_mutex_unlock(mutex)
        finished.set()
        return 0

    monkeypatch.setattr(REGISTRY["eval"], "run", stuck_command)
    # Python's own Ctrl-C handler, even when this test run was started with SIGINT ignored
    # (``cmd &`` without job control); restored afterwards
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=owner, daemon=True).start()
        held.wait(10)
        main_id = threading.main_thread().ident
        threading.Timer(0.5, lambda: signal.pthread_kill(main_id, signal.SIGINT)).start()
        res = cli("eval", "--model", "x", "--text", "y")
        returned_before_release = not release.is_set()
        release.set()
    finally:
        signal.signal(signal.SIGINT, old)
    assert finished.wait(30)
    assert res.rc == 130 and "interrupted" in res.err
    assert returned_before_release


@pytest.mark.parametrize("argv, needle", [
    (("generate", "--prompt", "hi", "--temperature", -1), "bad sampling settings"),
    (("generate", "--prompt", "hi", "--top-p", 0), "bad sampling settings"),
    (("eval", "--text", "/"), "is a directory"),
    (("calibrate", "--text", "builtin:calib", "--max-vectors", 10, "--out", "{tmp}/b.st"),
     "below the K=2**8"),
    (("demo", "--nbits", 13), "--nbits 13 / --max-vectors 4096: nbits must be an int in [1, 12]"),
])
def test_more_bad_flags_refused_before_any_output(error_line, cli, tiny_dir, tmp_path, argv, needle):
    argv = [str(a).replace("{tmp}", str(tmp_path)) for a in argv]
    res = cli(argv[0], "--model", tiny_dir, *argv[1:])
    assert needle in error_line(res) and res.out == ""

"""xgrammar's compiler in a child process of rank 0, so no grammar can stall the step loop or take rank 0 down.

Rank 0 sends one grammar at a time and polls for the answer between steps; requests whose grammar is compiling wait
outside the scheduler while the others keep stepping. A compile that overruns COMPILE_TIMEOUT_S is killed with its
process (xgrammar cannot be interrupted), and a native crash (xgrammar has had them on large bounded repeats) ends
only the child; either way the request gets a 400 naming the cause and the next grammar gets a fresh child. Compiled
grammars come back serialized and are kept in a byte-bounded LRU on rank 0.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

from worker.sampling.params import GrammarSpec

COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer to compile is refused (vLLM's proposed limit)
COMPILER_CACHE_BYTES = 512 << 20  # xgrammar's cache of compiled pieces in the child (vLLM's cap)
COMPILED_CACHE_BYTES = 256 << 20  # compiled grammars kept on rank 0, most recently used first
COMPILED_CACHE_ENTRIES = 256


@dataclass(frozen=True)
class CompileResult:
    """A finished compile for one request: the compiled grammar, or why there is none."""

    request_id: str
    compiled: object | None  # xgrammar.CompiledGrammar
    error: str | None = None


def _serve(conn) -> None:
    """The child: build the compiler once, then compile what arrives until rank 0 closes the socket."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # dies with rank 0 (PR_SET_PDEATHSIG)
    except (OSError, AttributeError):
        pass
    import xgrammar as xgr

    from worker.sampling.grammar import build_grammar

    tokenizer_loader, vocab_size, stop_ids = conn.recv()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer_loader(), vocab_size=vocab_size, stop_token_ids=list(stop_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=COMPILER_CACHE_BYTES)
    conn.send(("ready", None))
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", compiler.compile_grammar(build_grammar(spec)).serialize_json()))
        except Exception as e:  # noqa: BLE001 - the compiler's message is the client's 400
            conn.send(("error", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__))


class GrammarCompiler:
    """Rank 0's side: a queue of (request, grammar), one compile in flight, results collected by `poll`."""

    def __init__(
        self, tokenizer_loader, vocab_size: int, stop_ids: tuple[int, ...], timeout: float = COMPILE_TIMEOUT_S
    ):
        self._args = (tokenizer_loader, vocab_size, tuple(stop_ids))
        self.timeout = timeout
        self._queue: deque[tuple[str, GrammarSpec]] = deque()
        self._in_flight: tuple[str, GrammarSpec, float] | None = None  # request id, grammar, time sent
        self._proc = self._conn = None
        self._ready = False
        self._info = None  # rank 0's TokenizerInfo, to deserialize what the child sends
        self._cache: OrderedDict[GrammarSpec, tuple[object, int]] = OrderedDict()
        self._cache_bytes = 0
        self.restarts = 0  # children replaced after a timeout or a crash

    def submit(self, request_id: str, spec: GrammarSpec) -> CompileResult | None:
        """A cached grammar at once; else None, and `poll` returns it when compiled."""
        hit = self._cache.get(spec)
        if hit is not None:
            self._cache.move_to_end(spec)
            return CompileResult(request_id, hit[0])
        self._queue.append((request_id, spec))
        return None

    def cancel(self, request_id: str) -> bool:
        """Forget a queued request (an abort). One in flight finishes and its result is dropped."""
        for i, (rid, _) in enumerate(self._queue):
            if rid == request_id:
                del self._queue[i]
                return True
        if self._in_flight is not None and self._in_flight[0] == request_id:
            self._in_flight = (None, *self._in_flight[1:])
            return True
        return False

    @property
    def pid(self) -> int | None:
        """The compiling child's pid, while one runs."""
        return self._proc.pid if self._proc is not None else None

    @property
    def busy(self) -> bool:
        return bool(self._queue) or self._in_flight is not None

    def poll(self) -> list[CompileResult]:
        """Collect what finished, refuse what overran, send the next grammar; never blocks."""
        done: list[CompileResult] = []
        if self._in_flight is not None:
            rid, spec, sent = self._in_flight
            if self._conn.poll():
                try:
                    kind, payload = self._conn.recv()
                except (EOFError, OSError):
                    kind, payload = "crash", None
                self._in_flight = None
                if kind == "ok":
                    compiled = self._deserialize(payload)
                    self._remember(spec, compiled)
                    done.append(CompileResult(rid, compiled))
                elif kind == "error":
                    done.append(CompileResult(rid, None, payload))
                else:
                    self._restart()
                    done.append(CompileResult(rid, None, "the grammar compiler crashed on this grammar"))
            elif self._proc.poll() is not None:
                self._in_flight = None
                self._restart()
                done.append(CompileResult(rid, None, "the grammar compiler crashed on this grammar"))
            elif time.monotonic() - sent > self.timeout:
                self._in_flight = None
                self._restart()
                done.append(CompileResult(rid, None, f"compiling took longer than the limit of {self.timeout:g} s"))
        self._send_next()
        return [r for r in done if r.request_id is not None]

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
            self._conn.close()
            self._proc = self._conn = None

    def _start(self) -> None:
        """A plain subprocess (rank 0 is itself a daemonic multiprocessing child, which may not have its own), talking
        over a socket pair with multiprocessing's framing."""
        from multiprocessing.connection import Connection

        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "worker.sampling.grammar_process", str(theirs.fileno())]
        self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()])
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(self._args)
        self._ready = False

    def _restart(self) -> None:
        self.close()
        self.restarts += 1

    def _send_next(self) -> None:
        if self._in_flight is not None or not self._queue:
            return
        if self._proc is None:
            self._start()
        if not self._ready:  # the child builds its compiler first (seconds); the queue waits without a deadline
            if not self._conn.poll():
                if self._proc.poll() is not None:  # it could not start: the next poll starts another
                    self._restart()
                return
            self._conn.recv()
            self._ready = True
        rid, spec = self._queue.popleft()
        self._conn.send(spec)
        self._in_flight = (rid, spec, time.monotonic())

    def _deserialize(self, payload: str):
        import xgrammar as xgr

        if self._info is None:
            tokenizer_loader, vocab_size, stop_ids = self._args
            self._info = xgr.TokenizerInfo.from_huggingface(
                tokenizer_loader(), vocab_size=vocab_size, stop_token_ids=list(stop_ids)
            )
        return xgr.CompiledGrammar.deserialize_json(payload, self._info)

    def _remember(self, spec: GrammarSpec, compiled) -> None:
        size = int(compiled.memory_size_bytes)
        self._cache[spec] = (compiled, size)
        self._cache_bytes += size
        while self._cache and (self._cache_bytes > COMPILED_CACHE_BYTES or len(self._cache) > COMPILED_CACHE_ENTRIES):
            _, (_, old) = self._cache.popitem(last=False)
            self._cache_bytes -= old


if __name__ == "__main__":
    from multiprocessing.connection import Connection

    _serve(Connection(int(sys.argv[1])))

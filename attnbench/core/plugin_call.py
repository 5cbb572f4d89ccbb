"""Bounded calls into plugin code: a backend's ``resolve()`` of a workload, asked in a subprocess.

``resolve()`` (and the ``supports()``, ``interpreted()``, ``implementation()`` and ``tunables_for()``
hooks it combines) is plugin code that the parent process (``tune``, ``backends``, ``select()``) must call. A thread cannot bound a call that
hangs while holding the GIL, so for backends outside attnbench itself the calls run in a child
process (``python -m attnbench.core.plugin_call``) with a deadline: a backend that gives no answer in time is
left out with that reason, and the others still answer. Built-in backends are asked directly.

Answers are cached as JSON under ``$ATTNBENCH_CACHE_DIR/probes``, keyed by the backend's import path
and code hash, the workload's shape, dtype and device, its batch and context *buckets* (as tuning keys
are), and the torch version, so ``select()`` pays for the child process once per bucket and then reads
a small file. The price: a backend whose answer changes inside one bucket (a context limit that is
not a power of two) is answered for the first workload seen there; the worker asks ``supports()``
again on the exact workload before a candidate runs. A backend that gave no answer is asked again
after an hour.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from attnbench.core.backend import Backend, Resolution
from attnbench.core.child import Child
from attnbench.core.device import cache_dir
from attnbench.core.registry import code_hash, load_backend_class, plugin_timeout
from attnbench.core.workload import Workload, bucket, workload_from_dict, workload_to_dict

__all__ = ["ask", "ask_many"]

#: A backend that gave no answer is asked again after this long (until then, the cached refusal).
_RETRY_S = 3600.0


def _enc(value: Any) -> Any:
    """JSON keeps lists, not tuples: tag tuples so a tunable's choices come back exactly."""
    if isinstance(value, tuple):
        return {"tuple": [_enc(v) for v in value]}
    if isinstance(value, list):
        return [_enc(v) for v in value]
    return value


def _dec(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"tuple"}:
        return tuple(_dec(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_dec(v) for v in value]
    return value


def _encode(answer: Resolution) -> dict[str, Any]:
    d = answer.as_dict()
    d["tunables"] = [[n, _enc(tuple(c)), _enc(dflt), doc] for n, c, dflt, doc in d["tunables"]]
    return d


def _decode(data: dict[str, Any], workload: Workload) -> Resolution:
    fields = {k: v for k, v in data.items() if k != "expires"}
    fields["tunables"] = [[n, _dec(c), _dec(dflt), doc] for n, c, dflt, doc in fields["tunables"]]
    return Resolution.from_dict(fields, workload=workload)


def _failed(cls: type, workload: Workload, reason: str) -> Resolution:
    """A refusal built without asking the backend again (it hung, raised or would not load); ``cls``
    is only read for its name, lossiness and form (the abstract :class:`Backend` where none loaded)."""
    name = getattr(cls, "name", cls.__qualname__)
    return Resolution(
        backend=name,
        workload=workload,
        config={},
        reasons=(reason,),
        implementation="error",
        lossy=getattr(cls, "lossy", ""),
        kv_form=getattr(cls, "kv_form", "expanded"),
    )


def _direct(cls: type[Backend], workload: Workload) -> Resolution:
    try:
        return cls().resolve(workload)
    except Exception as err:  # a backend whose answers themselves break is left out, with the error
        return _failed(cls, workload, f"resolve() raised {type(err).__name__}: {err}")


def _trusted(cls: type[Backend]) -> bool:
    """Built-in backends are asked directly; so are classes a child process could not import."""
    local = "<locals>" in cls.__qualname__ or cls.__module__ == "__main__"
    return local or cls.__module__.split(".")[0] == "attnbench"


def _ref(cls: type[Backend]) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _cache_file(cls: type[Backend], workload: Workload) -> Path:

    try:
        code = code_hash([cls])
    except Exception:
        code = "?"
    # keyed by bucket, as tuning is: serving code calling select() for every new batch and context
    # pays for the child process once per bucket, not once per request shape
    where = workload_to_dict(workload) | {
        "context_lens": [bucket(max(1, workload.batch)), bucket(max(1, max(workload.context_lens)))]
    }
    key = json.dumps(["probe-3", _ref(cls), code, where, str(torch.__version__)], default=str)
    return cache_dir() / "probes" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


def ask(cls: type[Backend], workload: Workload, *, timeout: float | None = None) -> Resolution:
    """``cls().resolve(workload)`` with its default config (bounded in time for plugin code)."""
    return ask_many([cls], workload, timeout=timeout)[0]


def ask_many(
    classes: Sequence[type[Backend]], workload: Workload, *, timeout: float | None = None
) -> list[Resolution]:
    """Resolutions for each of ``classes``, in order: built-ins asked here, the rest in one child process
    (a new one after a backend that hangs), from the cache where it holds them."""
    timeout = plugin_timeout() if timeout is None else timeout
    out: dict[int, Resolution] = {}
    pending: list[int] = []
    for i, cls in enumerate(classes):
        if _trusted(cls):
            out[i] = _direct(cls, workload)
            continue
        path = _cache_file(cls, workload)
        try:
            cached = json.loads(path.read_text())
            if cached.get("expires", math.inf) < time.time():
                raise ValueError("expired")
            out[i] = _decode(cached, workload)
        except (OSError, ValueError, KeyError, TypeError):
            pending.append(i)
    while pending:
        answered = _ask_child([classes[i] for i in pending], workload, timeout=timeout)
        for i, answer in zip(pending, answered, strict=False):
            out[i] = answer
            _store(_cache_file(classes[i], workload), _encode(answer))
        done = len(answered)
        if done < len(pending):  # the next one hung or the child died: say so, go on after it
            i = pending[done]
            out[i] = _failed(
                classes[i],
                workload,
                f"plugin backend {classes[i].name!r} gave no answer to supports() within {timeout:g} s "
                "(hangs, or its process died); left out (ATTNBENCH_PLUGIN_TIMEOUT sets the limit)",
            )
            # remembered for a while, so a hanging plugin does not cost every call its timeout
            _store(_cache_file(classes[i], workload), _encode(out[i]) | {"expires": time.time() + _RETRY_S})
            done += 1
        pending = pending[done:]
    return [out[i] for i in range(len(classes))]


def _store(path: Path, data: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, default=str))
        os.replace(tmp, path)
    except OSError:
        pass  # an unwritable cache only costs time


def _ask_child(classes: Sequence[type[Backend]], workload: Workload, *, timeout: float) -> list[Resolution]:
    """Answers from one child process, one line each, until one takes longer than ``timeout``."""
    request = {
        "sys_path": sys.path,
        "refs": [_ref(c) for c in classes],
        "workload": workload_to_dict(workload),
    }
    answers: list[Resolution] = []
    with Child(["-m", "attnbench.core.plugin_call"]) as child:
        child.send(request)
        child.close_input()
        first = child.receive(max(120.0, timeout))  # first the child imports torch, then "ready"
        while first is not None and len(answers) < len(classes):
            line = child.receive(timeout)
            if line is None:
                break
            answers.append(_decode(line, workload))
    return answers


def main() -> None:
    """The child: load each backend by import path, answer one JSON line per backend."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the plugin prints goes to stderr, never into the answers
    request = json.loads(sys.stdin.readline())
    for entry in reversed(request["sys_path"]):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    workload = workload_from_dict(request["workload"])
    proto.write('{"ready": true}\n')
    for ref in request["refs"]:
        try:
            answer = _direct(load_backend_class(ref), workload)
        except Exception as err:
            answer = _failed(Backend, workload, f"loading {ref} raised {type(err).__name__}: {err}")
        proto.write(json.dumps(_encode(answer), default=str) + "\n")


if __name__ == "__main__":
    main()

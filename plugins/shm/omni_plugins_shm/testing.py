"""Helpers for tests and benchmarks in any area (runtime, soak, examples).

Leak check: ``assert_namespace_empty(ns)`` raises ``AssertionError`` listing what is left.
"""

from __future__ import annotations

import os
import uuid

from omni_plugins_shm.gc import DEFAULT_SHM_DIR
from omni_plugins_shm.naming import Names, namespace_prefix, publish_dir_name, relative_path


def namespace_segments(namespace: str, shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Names of every file of ``namespace`` (segments and liveness markers), sorted.

    Names in the publish directory are listed bare (like the others; :func:`segment_path`
    gives the full path). The namespace's infrastructure -- the publish directory and its
    wake file (``x.wake``) -- is listed only when nothing else of the namespace is left: it
    must not outlive the namespace's last instance, but it is not per-payload state (a
    crashed instance's leftovers are listed without it; gc removes all of it together).
    """
    prefix = namespace_prefix(namespace)
    try:
        top = [name for name in os.listdir(shm_dir) if name.startswith(prefix)]
    except FileNotFoundError:
        return []
    pubdir = publish_dir_name(namespace)
    wake = Names(namespace).wake()
    table = Names(namespace).slots()
    out = [name for name in top if name != pubdir]
    if pubdir in top:
        try:
            inner = [name for name in os.listdir(os.path.join(shm_dir, pubdir)) if name.startswith(prefix)]
        except (FileNotFoundError, NotADirectoryError):
            inner = []
        out += [name for name in inner if name not in (wake, table)]
        if not out:
            out = [n for n in (wake, table) if n in inner] or [pubdir]
    return sorted(out)


def slot_payloads(namespace: str, shm_dir: str = DEFAULT_SHM_DIR) -> int:
    """How many payloads wait in ``namespace``'s slot table (READY slots; 0 without a table or the C extension).

    With :func:`namespace_segments` (which lists the file path's ``k.``/``h.`` payloads) this counts
    every unconsumed payload of the namespace.
    """
    import mmap

    from omni_plugins_shm import slots, wakeslots

    native = wakeslots._futex
    path = os.path.join(shm_dir, publish_dir_name(namespace), Names(namespace).slots())
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return 0
    try:
        if native is None:
            return 0
        # slot_scan takes a writable buffer (it only reads here)
        mm = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            return sum(1 for item in native.slot_scan(mm) if slots.word_kind(item[1]) == slots.READY)
        finally:
            mm.close()
    finally:
        os.close(fd)


def segment_path(name: str, shm_dir: str = DEFAULT_SHM_DIR) -> str:
    """Full path of a segment or marker named ``name`` (as listed by :func:`namespace_segments`)."""
    return os.path.join(shm_dir, relative_path(name))


def assert_namespace_empty(namespace: str, shm_dir: str = DEFAULT_SHM_DIR) -> None:
    """Fail if any file of ``namespace`` remains in ``shm_dir`` (call after closing every connector)."""
    left = namespace_segments(namespace, shm_dir)
    assert not left, f"shm namespace {namespace!r} leaked {len(left)} file(s) in {shm_dir}: {left[:10]}"


def unique_namespace(prefix: str = "t") -> str:
    """A fresh namespace name for one test (valid for ``ShmConfig.namespace``)."""
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def shm_config(namespace: str, **overrides: object) -> dict[str, object]:
    """A config dict for ``create_connector("shm", ...)`` in ``namespace``."""
    return {"namespace": namespace, **overrides}


# -- multi-process workers (picklable by reference, for ``multiprocessing.get_context("spawn")``) ----------


def make_payload(seed: int, nbytes: int) -> dict[str, object]:
    """A deterministic payload of about ``nbytes`` bytes of tensor data (rebuild it to verify a get)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4)
    return {"x": torch.randn(n, generator=g), "seed": seed, "tag": f"payload-{seed}"}


def payload_matches(data: object, seed: int, nbytes: int) -> bool:
    import torch

    want = make_payload(seed, nbytes)
    return (
        isinstance(data, dict)
        and data.get("seed") == seed
        and data.get("tag") == want["tag"]
        and isinstance(data.get("x"), torch.Tensor)
        and torch.equal(data["x"], want["x"])  # type: ignore[arg-type]
    )


def result_status(res: object, seed: int, nbytes: int) -> str:
    """``"missing"`` (a get returned None), ``"ok"`` (its data is ``make_payload(seed, nbytes)``'s) or ``"mismatch"``."""
    return "missing" if res is None else ("ok" if payload_matches(res.data, seed, nbytes) else "mismatch")  # type: ignore[attr-defined]


def producer_worker(config: dict[str, object], items: list[tuple[str, int, int]], ready: object = None, hold: object = None) -> None:
    """Put ``(key, seed, nbytes)`` items; then signal ``ready`` (a queue) and wait on ``hold`` (an event) before closing."""
    from omni_plugins import create_connector

    with create_connector("shm", config) as conn:
        for key, seed, nbytes in items:
            if not conn.put(0, 1, key, make_payload(seed, nbytes)).ok:
                raise SystemExit(f"put {key} failed")
        if ready is not None:
            ready.put(len(items))  # type: ignore[attr-defined]
        if hold is not None:
            hold.wait(120)  # type: ignore[attr-defined]


def ttl_producer_worker(config: dict[str, object], items: list[tuple[str, int, int]], ready: object, go: object, hold: object) -> None:
    """Put ``items`` (the payloads nobody will claim), signal ``ready``; on ``go`` sleep past the config's
    ``ttl_seconds`` and put ``("fresh", 0, 1024)`` (the put that reclaims the expired ones), report
    ``health()["expired"]`` to ``ready``, then wait on ``hold`` before closing."""
    import time

    from omni_plugins import create_connector

    with create_connector("shm", config) as conn:
        for key, seed, nbytes in items:
            conn.put(0, 1, key, make_payload(seed, nbytes))
        ready.put(len(items))  # type: ignore[attr-defined]
        go.wait(120)  # type: ignore[attr-defined]
        time.sleep(2 * float(config["ttl_seconds"]))  # type: ignore[arg-type]
        conn.put(0, 1, "fresh", make_payload(0, 1024))
        ready.put(conn.health()["expired"])  # type: ignore[attr-defined]
        hold.wait(120)  # type: ignore[attr-defined]


def consumer_worker(config: dict[str, object], items: list[tuple[str, int, int]], out: object, timeout: float = 30.0) -> None:
    """Blocking-get each item; report ``(key, "ok" | "missing" | "mismatch")`` tuples to the queue ``out``."""
    from omni_plugins import create_connector

    results = []
    with create_connector("shm", config) as conn:
        for key, seed, nbytes in items:
            res = conn.get(0, 1, key, timeout=timeout)
            results.append((key, result_status(res, seed, nbytes)))
    out.put(results)  # type: ignore[attr-defined]


def pipeline_consumer_worker(
    config: dict[str, object], race_keys: list[str], items: list[tuple[str, int, int]], out: object, timeout: float = 60.0
) -> None:
    """First try to take each of ``race_keys`` without waiting (other consumers race for them), then
    blocking-get ``items``. Reports ``{"won": [...], "items": [(key, status), ...]}`` to the queue ``out``."""
    from omni_plugins import create_connector

    won, results = [], []
    with create_connector("shm", config) as conn:
        for key in race_keys:
            if conn.get(0, 1, key) is not None:
                won.append(key)
        for key, seed, nbytes in items:
            res = conn.get(0, 1, key, timeout=timeout)
            results.append((key, result_status(res, seed, nbytes)))
            del res
    out.put({"won": won, "items": results})  # type: ignore[attr-defined]


def stalled_producer_worker(config: dict[str, object], count: int, nbytes: int, ready: object) -> None:
    """Put ``count`` payloads (keys ``stalled-<i>``, seeds ``i``), signal ``ready``, then hang (for SIGKILL tests)."""
    import time

    from omni_plugins import create_connector

    conn = create_connector("shm", config)
    for i in range(count):
        conn.put(0, 1, f"stalled-{i}", make_payload(i, nbytes))
    ready.put(count)  # type: ignore[attr-defined]
    while True:
        time.sleep(1)


def view_holder_worker(config: dict[str, object], key: str, ready: object) -> None:
    """Take a zero-copy view of ``key`` and hold it forever (for SIGKILL tests of a consumer)."""
    import time

    from omni_plugins import create_connector

    conn = create_connector("shm", config)
    res = conn.get_views(0, 1, key, timeout=60)  # type: ignore[attr-defined]
    ready.put(res is not None)  # type: ignore[attr-defined]
    while True:
        time.sleep(1)


def waiting_consumer_worker(config: dict[str, object], key: str, ready: object) -> None:
    """Signal ``ready``, then block in ``get(key)`` for up to two minutes (for tests that SIGKILL a waiting consumer)."""
    from omni_plugins import create_connector

    conn = create_connector("shm", config)
    ready.put(conn.owner_token)  # type: ignore[attr-defined]
    conn.get(0, 1, key, timeout=120)


def killed_after_publish_worker(config: dict[str, object], key: str, seed: int, nbytes: int) -> None:
    """Put ``key`` and die by SIGKILL right after the publishing rename, before the wake-up ring.

    Fault injection for "a producer killed mid-publish": the payload is published, nobody is woken.
    """
    import signal

    from omni_plugins import create_connector
    from omni_plugins_shm.segments import pool

    publish = pool.ProducerPool.publish

    def publish_then_die(self: pool.ProducerPool, seg: pool.Segment, published_path: str) -> bool:
        if publish(self, seg, published_path):
            os.kill(os.getpid(), signal.SIGKILL)
        return False

    pool.ProducerPool.publish = publish_then_die  # type: ignore[method-assign]
    conn = create_connector("shm", config)
    conn.put(0, 1, key, make_payload(seed, nbytes))


def slot_crash_worker(config: dict[str, object], key: str, stage: str, ready: object, nbytes: int = 1024) -> None:
    """Die by SIGKILL holding a slot of the namespace's slot table (``config`` must enable it).

    ``stage="writing"``: a FREE slot of the class a payload of ``nbytes`` takes, taken (CAS FREE -> WRITING(me))
    as a ``put`` does before it copies; ``stage="claimed"``: ``key`` put (``nbytes`` of payload), then its slot
    claimed (CAS READY -> CLAIMED(me)) as a ``get`` does before it copies out. Unit-level fault injection on the real table: the crash lands exactly between
    the CAS and the release. Reports the slot index to ``ready`` (the sending end of a ``Pipe``: written
    synchronously, unlike a queue's feeder thread that the SIGKILL would stop) first.
    """
    import signal

    from omni_plugins import create_connector
    from omni_plugins_shm import slots as slot_table

    conn = create_connector("shm", config)
    table = conn._slots  # type: ignore[attr-defined]
    native = table._native
    if stage == "claimed":
        conn.put(0, 1, key, make_payload(1, nbytes))
        info = next(i for i in table.scan() if i.key == key.encode())
        assert native.slot_cas(table.mm, info.slot, info.word, table.claimer)
    else:
        first = slot_table.first_slot_for(table.classes, nbytes + 4096)
        index = next(i for i in range(first, table.nslots) if native.slot_cas(table.mm, i, slot_table.FREE, table.writing))
        info = slot_table.SlotInfo(index, table.writing, 0, 0.0, b"")
    ready.send(info.slot)  # type: ignore[attr-defined]
    os.kill(os.getpid(), signal.SIGKILL)


# -- running short of file descriptors (real RLIMIT_NOFILE in a child process) ----------------------------


def lower_descriptor_limit(headroom: int) -> tuple[int, int]:
    """Lower this process's soft ``RLIMIT_NOFILE`` to ``headroom`` above the highest descriptor open; the old limits."""
    import resource

    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = max(int(n) for n in os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (top + headroom, old[1]))
    return old


def fill_descriptors() -> tuple[list[int], tuple[int, int]]:
    """Put this process at its descriptor limit: lower the soft ``RLIMIT_NOFILE`` to just above the highest
    descriptor open and open ``/dev/null`` until ``EMFILE``. Returns the fillers and the old limits for
    :func:`free_descriptors`. Fault injection for tests, in a child process of their own."""
    import errno

    old = lower_descriptor_limit(8)
    fillers = []
    while True:
        try:
            fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                raise
            return fillers, old


def free_descriptors(fillers: list[int], old: tuple[int, int]) -> None:
    import resource

    for fd in fillers:
        os.close(fd)
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


def _outcome(exc: BaseException) -> dict[str, object]:
    from omni_plugins.errors import CorruptPayloadError, TransientConnectorError

    return {"type": type(exc).__name__, "message": str(exc), "transient": isinstance(exc, TransientConnectorError), "corrupt": isinstance(exc, CorruptPayloadError)}


def fd_starved_consumer_worker(config: dict[str, object], items: list[tuple[str, int, int]], pipe: object) -> None:
    """Get ``items`` = [warm, cached, fresh] (``(key, seed, nbytes)``) in steps the parent drives over ``pipe``
    (a ``Pipe`` end: it needs no new descriptor to talk).

    1. Blocking-get ``warm`` (its pooled segment gets mapped and cached); send its status; wait for "go"
       (the parent then put ``cached``, which reuses that segment, and ``fresh``, in a new one).
    2. At the descriptor limit (:func:`fill_descriptors`): get ``cached`` (no descriptor needed) and then
       ``fresh`` (its segment must be opened); send what each did; wait for "free".
    3. With the descriptors back: get ``fresh`` again; send its status.
    """
    from omni_plugins import create_connector

    (warm, warm_seed, warm_n), (cached, cached_seed, cached_n), (fresh, fresh_seed, fresh_n) = items

    with create_connector("shm", config) as conn:
        pipe.send(result_status(conn.get(0, 1, warm, timeout=60), warm_seed, warm_n))  # type: ignore[attr-defined]
        assert pipe.recv() == "go"  # type: ignore[attr-defined]
        fillers, old = fill_descriptors()
        report: dict[str, object] = {}
        try:
            report["cached"] = result_status(conn.get(0, 1, cached), cached_seed, cached_n)
        except Exception as exc:
            report["cached"] = _outcome(exc)
        try:
            report["fresh"] = result_status(conn.get(0, 1, fresh, timeout=5), fresh_seed, fresh_n)
        except Exception as exc:
            report["fresh"] = _outcome(exc)
        pipe.send(report)  # type: ignore[attr-defined]
        assert pipe.recv() == "free"  # type: ignore[attr-defined]
        free_descriptors(fillers, old)
        pipe.send(result_status(conn.get(0, 1, fresh, timeout=5), fresh_seed, fresh_n))  # type: ignore[attr-defined]


def last_chunk(seed: int, nbytes: int) -> dict[str, object]:
    """A streaming chunk that ends its stream, carrying ``make_payload(seed, nbytes)``'s tensor."""
    return {"embed": {"x": make_payload(seed, nbytes)["x"]}, "meta": {"finished": True}}


def fd_starved_runtime_worker(config: dict[str, object], seed: int, nbytes: int, pipe: object) -> None:
    """A consumer stage's runtime (streaming, request "r" from stage 0) at its descriptor limit while its chunk
    (:func:`last_chunk`) arrives: once the receive thread reports a transient get failure the descriptors are
    freed; sends what the runtime delivered to ``pipe``."""
    import time
    from types import SimpleNamespace

    from omni_plugins import StageConfig
    from omni_plugins.runtime import RuntimeTuning, StageTransferRuntime

    class Request(SimpleNamespace):
        def is_finished(self) -> bool:
            return False

    rt = StageTransferRuntime(
        StageConfig(stage_id=1, async_chunk=True, recv_timeout_s=120),
        {"name": "shm", "extra": config},
        tuning=RuntimeTuning(join_timeout_s=5.0, drain_timeout_s=2.0),
    )
    try:
        assert rt.register_chunk_recv(Request(request_id="r", external_req_id=None))
        deadline = time.monotonic() + 60
        # the receive thread's first wait opens (and closes) descriptors of its own: fill only after it, so
        # that none is freed under the fillers and the get finds one
        while rt.debug_state()["receiver"]["waits"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        fillers, old = fill_descriptors()
        pipe.send("starved")  # type: ignore[attr-defined]
        while rt.debug_state()["receiver"]["transient"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        transient_while_starved = rt.debug_state()["receiver"]["transient"]
        free_descriptors(fillers, old)
        signals = []
        while time.monotonic() < deadline:
            sig = rt.collect_signals()
            signals.append(sig)
            if sig.chunk_finished or sig.failed or sig.timed_out:
                break
            time.sleep(0.01)
        import torch

        payload = rt.get_local_stage_payload("r")
        intact = payload is not None and torch.equal(payload["embed"]["x"], make_payload(seed, nbytes)["x"])  # type: ignore[arg-type]
        pipe.send(  # type: ignore[attr-defined]
            {
                "transient": transient_while_starved,
                "finished": sorted(set().union(*(s.chunk_finished for s in signals))),
                "failed": sorted(set().union(*(s.failed for s in signals))),
                "timed_out": sorted(set().union(*(s.timed_out for s in signals))),
                "payload_ok": intact,
            }
        )
    finally:
        rt.shutdown()


def fd_starved_judge_worker(namespace: str, segment: str, owner_token: str, pipe: object) -> None:
    """At the descriptor limit, ask what gc asks before removing anything: the header of ``segment`` (a name
    :func:`namespace_segments` lists) and whether the process of ``owner_token`` lives; then run gc on
    ``namespace``. Sends ``{"header": ..., "alive": ..., "gc": ...}`` (each a result or ``"errno <n>"``)."""
    from omni_plugins_shm import gc
    from omni_plugins_shm.proc import Owner

    owner = Owner.parse(owner_token)
    assert owner is not None
    fillers, old = fill_descriptors()
    report: dict[str, object] = {}
    for what, call in (
        ("header", lambda: gc.read_header(segment_path(segment)) is not None),
        ("alive", owner.process_alive),
        ("gc", lambda: gc.collect(namespace).removed),
    ):
        try:
            report[what] = call()
        except OSError as exc:
            report[what] = f"errno {exc.errno}"
    free_descriptors(fillers, old)
    pipe.send(report)  # type: ignore[attr-defined]


def low_limit_views_worker(config: dict[str, object], items: list[tuple[str, int, int]], headroom: int, pipe: object) -> None:
    """With the soft ``RLIMIT_NOFILE`` lowered to ``headroom`` above the highest descriptor open, take zero-copy
    views of every item (``(key, seed, nbytes)``) and hold them all; send the statuses, then whether the views
    still match (every item in a segment of its own while the views pin it)."""
    import resource

    from omni_plugins import create_connector

    old = lower_descriptor_limit(headroom)
    held, statuses = [], []
    with create_connector("shm", config) as conn:
        for key, _, _ in items:
            try:
                res = conn.get_views(0, 1, key, timeout=30)  # type: ignore[attr-defined]
            except Exception as exc:
                statuses.append(f"{type(exc).__name__}: {exc}")
                break
            statuses.append("missing" if res is None else "ok")
            held.append(res)
        pipe.send(statuses)  # type: ignore[attr-defined]
        intact = len(held) == len(items) and all(payload_matches(r.data, seed, nbytes) for r, (_, seed, nbytes) in zip(held, items, strict=True))
        del held, res
        pipe.send(intact)  # type: ignore[attr-defined]
    resource.setrlimit(resource.RLIMIT_NOFILE, old)


def descriptor_mappings_worker(config: dict[str, object], items: list[tuple[str, int, int]], fresh: tuple[str, int, int], pipe: object) -> None:
    """The connector as installed without the C extension before Python 3.13 (every mapping keeps a descriptor:
    fault injection by switching ``map_shared`` off), created under a soft ``RLIMIT_NOFILE`` 64 above the highest
    descriptor open. Gets ``items`` (owned copies: their segments come back to the producer, their mappings stay
    cached), reports the map cache's size and cap, then at the descriptor limit (:func:`fill_descriptors`) gets
    ``fresh``: the cache gives up its mappings and the get succeeds. Sends ``{"statuses", "cached", "cap",
    "fresh"}``."""
    import resource

    from omni_plugins import create_connector
    from omni_plugins_shm import connector as connector_module
    from omni_plugins_shm.segments import files, mapcache

    files._native_map = None
    files.MAPPING_HOLDS_FD = mapcache.MAPPING_HOLDS_FD = connector_module.MAPPING_HOLDS_FD = True
    old = lower_descriptor_limit(64)
    report: dict[str, object] = {"cap": mapcache.descriptor_cap()}
    with create_connector("shm", config) as conn:
        statuses = []
        for key, seed, nbytes in items:
            res = conn.get(0, 1, key, timeout=30)
            statuses.append(result_status(res, seed, nbytes))
            del res
        report["statuses"] = statuses
        report["cached"] = conn.health()["cached_mappings"]
        fillers, fill_old = fill_descriptors()
        try:
            res = conn.get(0, 1, fresh[0], timeout=5)
            report["fresh"] = result_status(res, fresh[1], fresh[2])
            del res
        except Exception as exc:
            report["fresh"] = _outcome(exc)
        report["cached_after"] = conn.health()["cached_mappings"]
        free_descriptors(fillers, fill_old)
    resource.setrlimit(resource.RLIMIT_NOFILE, old)
    pipe.send(report)  # type: ignore[attr-defined]

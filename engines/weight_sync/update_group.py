# longer than 400 lines: the live sync's wire format and its class, sender and receiver of one protocol
"""Live weight sync: the model update group (ROLL's `ModelUpdateGroup`, verl/OpenRLHF's weight broadcast).

One `torch.distributed` process group of its own (its own TCPStore, never the default group, so it
lives beside a trainer's DDP/FSDP2 group): rank 0 is the trainer that sends, ranks 1..N are generation
engines that receive. Each member builds `ModelUpdateGroup(master_addr, master_port, world_size, rank)`
at the same time (the constructors meet in the store, so Ray actors can join a trainer later, from any
node). One sync of policy version v:

1. plan: the sender splits the named tensors into buckets of at most `bucket_bytes` in the wire dtype
   (the generation side's dtype: bf16 on GPU) and puts the plan (names, shapes, offsets) in the store.
2. check: each receiver checks the plan against its engine (names, shapes, dtype) and answers; the
   sender says go, or aborts naming every engine that refused. Nothing has moved: every engine keeps
   the version it served.
3. buckets: the sender fills one flat buffer per bucket, gathering each parameter as the bucket fills
   (`full_tensor()` of an FSDP2 DTensor, `GatheredParameters` of a ZeRO-3 parameter; never the whole
   model), cast to the wire dtype, then either broadcasts it (transport "broadcast": gloo on CPU, nccl
   on GPU) or writes it into one buffer the engines on the same node map (transport "shm": a file in
   /dev/shm; "cuda_ipc": a CUDA buffer shared by IPC handle), with the group used only for a small
   signal and a barrier. Each engine copies the bucket's tensors into its weights in place
   (`engine.update_weights(pairs, partial=True)`).
4. verify: each receiver reports (version served, buckets, checksum of the bytes it applied); the
   sender compares with its own and raises `WeightSyncError` naming the engine on any difference.

A member that dies mid-sync (a killed generation actor) fails the sender's next collective or store
wait within `timeout_s`; the error names the engines that fell behind (per-bucket progress counters in
the store) and the version. A failed sync leaves the group unusable (build a new one, on a new port) and
the engines that got part of it refuse to generate until they get a full update (`load_weights` of the
last good version, or a new sync): never a silent stale or torn policy.

Notation: B bytes of a bucket; every tensor starts at a 64-byte aligned offset in it.

The parts that need no group (the receiver protocol, the report, the per-parameter gathers and a hybrid
worker's in-process copy) are engines/weight_sync/gather.py.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import pickle
import socket
import time
from typing import Iterable

import torch
import torch.distributed as dist

from engines.weight_sync.gather import (
    SyncReport, WeightReceiver, full_shape, gather_only, gathered, is_partial, numel)

SYNC_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TRANSPORTS = ("broadcast", "shm", "cuda_ipc")
ALIGN = 64  # bytes: each tensor's offset in a bucket (any dtype view stays aligned)


class WeightSyncError(RuntimeError):
    """A live sync that did not reach every engine; the message names the engine(s) and the version."""


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_buckets(shapes: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, bucket_bytes: int) -> list[list[list]]:
    """Buckets of [name, shape, offset] in order, each at most `bucket_bytes` (aligned offsets). A tensor
    larger than a bucket is an error (no chunking: the bucket must hold the largest tensor)."""
    size = torch.empty((), dtype=dtype).element_size()
    biggest = max(shapes, key=lambda s: numel(s[1]), default=None)
    if biggest is not None and numel(biggest[1]) * size > bucket_bytes:
        raise ValueError(f"weight sync bucket_bytes={bucket_bytes} is below the largest tensor: {biggest[0]} "
                         f"{list(biggest[1])} is {numel(biggest[1]) * size} bytes in {dtype}; set bucket_bytes >= "
                         f"{numel(biggest[1]) * size} (tensors are not split across buckets)")
    buckets, cur, used = [], [], 0
    for name, shape in shapes:
        nbytes = numel(shape) * size
        if cur and align(used) + nbytes > bucket_bytes:
            buckets.append(cur)
            cur, used = [], 0
        cur.append([name, list(shape), align(used)])
        used = align(used) + nbytes
    if cur:
        buckets.append(cur)
    return buckets


def bucket_nbytes(bucket: list[list], dtype: torch.dtype) -> int:
    name, shape, off = bucket[-1]
    return align(off + numel(shape) * torch.empty((), dtype=dtype).element_size())


DEATH_GRACE_S = 2.0   # how long a failed sync waits for a same-node engine's exit to show before calling it stuck


def _alive(pid: int) -> bool:
    """Whether a process of this node runs (a zombie, killed and not yet reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def checksum(buf: torch.Tensor) -> int:
    """Sum of the bucket's 64-bit words, wrapping (buf: uint8, length a multiple of ALIGN): one vectorised
    pass (~0.02 s for 270 MB on one core; an int32 -> int64 sum took 0.7 s), any flipped bit changes it."""
    return int(buf.view(torch.int64).sum())


def unpack(buf: torch.Tensor, bucket: list[list], dtype: torch.dtype):
    """(name, view) of each tensor of a bucket inside the flat uint8 buffer: no copy."""
    size = torch.empty((), dtype=dtype).element_size()
    for name, shape, off in bucket:
        yield name, buf[off: off + numel(shape) * size].view(dtype).view(shape)


class ModelUpdateGroup:
    """One member of the update group; see the module docstring.

    transport: "broadcast" (backend "gloo" on CPU, "nccl" on GPU: the NCCL path is present, not run in
    CI), "shm" (every member on one node, CPU; a gloo group carries the signals) or "cuda_ipc" (one node,
    GPU; code path present, not run in CI). timeout_s bounds every collective and store wait: a member
    that dies mid-sync is an error after at most that long, never a hang."""

    def __init__(self, master_addr: str, master_port: int, world_size: int, rank: int, backend: str = "gloo",
                 transport: str = "broadcast", timeout_s: float = 60.0, join_timeout_s: float = 300.0,
                 name: str = "flyroll-weights", member: str | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"weight sync transport {transport!r}: expected one of {list(TRANSPORTS)}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"weight sync group: rank {rank} of world_size {world_size} (rank 0 sends, 1..N receive)")
        self.rank, self.world_size, self.transport, self.timeout_s = rank, world_size, transport, timeout_s
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.member = member or f"rank {rank}"
        join = datetime.timedelta(seconds=join_timeout_s)            # every member must arrive within this
        tcp = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=join)
        self.store = dist.PrefixStore(name, tcp)
        self._tcp = tcp
        backend = "gloo" if transport != "broadcast" else backend
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(dist.PrefixStore("pg", self.store), rank, world_size)
        elif backend == "gloo":
            self.device = torch.device("cuda", torch.cuda.current_device()) if transport == "cuda_ipc" else torch.device("cpu")
            self.pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", self.store), rank, world_size, join)
        else:
            raise ValueError(f"weight sync backend {backend!r}: expected 'gloo' or 'nccl'")
        self.backend = backend
        self.store.set(f"member/{rank}", json.dumps({"member": self.member, "host": socket.gethostname(), "pid": os.getpid()}))
        self.members = {r: json.loads(self.store.get(f"member/{r}")) for r in range(world_size)}
        tcp.set_timeout(self.timeout)                                 # from here on: every wait bounded by timeout_s
        if transport != "broadcast" and len({m["host"] for m in self.members.values()}) > 1:
            raise ValueError(f"weight sync transport {transport!r} needs every member on one node; members: {self.members}")
        self.seq = 0
        self.broken: str | None = None
        self._buf: torch.Tensor | None = None   # the bucket buffer (uint8), reused across buckets and syncs
        self._shared: str | None = None         # shm path / IPC handle of the buffer
        self._shared_for: torch.Tensor | None = None

    # ---------------------------------------------------------------- helpers
    def _get(self, key: str) -> bytes:
        self.store.wait([key], self.timeout)
        return self.store.get(key)

    def _who(self, r: int) -> str:
        return f"engine rank {r} ({self.members[r]['member']}, pid {self.members[r]['pid']} on {self.members[r]['host']})"

    def _collective(self, op: str, tensor: torch.Tensor) -> None:
        if op == "broadcast":
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.timeout = 0, self.timeout
            self.pg.broadcast([tensor], opts).wait()
        else:
            opts = dist.AllreduceOptions()
            opts.timeout = self.timeout
            self.pg.allreduce([tensor], opts).wait()

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def _check_usable(self) -> None:
        if self.broken:
            raise WeightSyncError(f"weight sync group is unusable after an earlier failure ({self.broken}); build a new one")

    # ---------------------------------------------------------------- sender (rank 0)
    def send(self, named_params: Iterable[tuple[str, torch.Tensor]], version: int, dtype: str = "float32",
             bucket_bytes: int = 256 << 20) -> SyncReport:
        """Send one policy version to every engine; returns when each has verified it (or raises).
        Sharded parameters are gathered one at a time as their bucket fills; the other training ranks
        run `gather_only(named_params)` meanwhile, and a failed send still makes every gather they wait for."""
        if self.rank != 0:
            raise RuntimeError(f"send on rank {self.rank}: rank 0 sends, ranks 1..N receive")
        params = list(named_params)                                   # references only, nothing gathered yet
        self._gathers = 0                                             # params gathered so far, in `params` order
        try:
            return self._send(params, version, dtype, bucket_bytes)
        except BaseException:
            # the other training ranks run `gather_only` over every parameter: make the gathers they still
            # wait for, so a failed or refused sync leaves them free instead of stuck in a collective
            with contextlib.suppress(Exception):
                gather_only(params[self._gathers:])
            raise

    def _send(self, params: list, version: int, dtype: str, bucket_bytes: int) -> SyncReport:
        self._check_usable()
        if dtype not in SYNC_DTYPES:
            raise ValueError(f"weight sync dtype {dtype!r}: expected one of {list(SYNC_DTYPES)}")
        wire, start = SYNC_DTYPES[dtype], time.perf_counter()
        buckets = plan_buckets([(n, full_shape(t)) for n, t in params], wire, bucket_bytes)
        self.seq += 1
        s = f"s{self.seq}"
        if self.seq > 1:
            self.store.delete_key(f"s{self.seq - 1}/plan")
        plan = {"version": version, "dtype": dtype, "buckets": buckets, "capacity": align(bucket_bytes)}
        buf = self._sender_buffer(max((bucket_nbytes(b, wire) for b in buckets), default=ALIGN))
        if self.transport != "broadcast":
            plan["shared"] = self._share(buf)
        self.store.set(f"{s}/plan", json.dumps(plan))
        refusals = []
        for r in range(1, self.world_size):
            answer = self._wait_for(f"{s}/ack/{r}", version, "check the plan")
            if answer != "ok":
                refusals.append(f"{self._who(r)}: {answer}")
        self.store.set(f"{s}/go", "abort" if refusals else "go")
        if refusals:
            raise ValueError(f"weight sync of policy v{version} refused before any byte moved (every engine keeps its "
                             "version): " + "; ".join(refusals))
        by_name, total, sums, sent, peak = dict(params), 0, 0, 0, 0
        try:
            for i, bucket in enumerate(buckets):
                n = bucket_nbytes(bucket, wire)
                view = buf[:n]
                # (alignment gaps keep whatever bytes they held: both sides checksum the same bytes)
                for name, slot in unpack(view, bucket, wire):
                    partial = is_partial(by_name[name])                   # (before the gather makes it whole)
                    with gathered(by_name[name]) as full:                 # one parameter gathered at a time
                        self._gathers += 1
                        if partial:
                            peak = max(peak, full.numel() * full.element_size())
                        slot.copy_(full)                                  # cast to the wire dtype
                sums += checksum(view)
                total += sum(numel(b[1]) for b in bucket) * wire.itemsize
                if self.transport == "broadcast":
                    self._collective("broadcast", view)
                else:
                    if view.is_cuda:
                        torch.cuda.synchronize(view.device)
                    signal = torch.tensor([i, 0], dtype=torch.int64)
                    self._collective("broadcast", signal)                 # bucket i is in the shared buffer
                    self._collective("allreduce", signal)                 # ...and every engine has copied it
                sent = i + 1
            reports = {r: json.loads(self._wait_for(f"{s}/done/{r}", version, "report")) for r in range(1, self.world_size)}
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - a collective failed: a member is gone or stuck
            self.broken = f"v{version}: {e}"
            raise WeightSyncError(f"weight sync of policy v{version} failed after {sent}/{len(buckets)} buckets: "
                                  f"{self._behind(s, len(buckets), version)} ({type(e).__name__}: {str(e)[:200]})") from e
        for r, rep in reports.items():
            if rep.get("error") or rep["version"] != version or rep["buckets"] != len(buckets) or rep["checksum"] != sums:
                self.broken = f"v{version}: {self._who(r)} reported {rep}"
                raise WeightSyncError(f"weight sync of policy v{version}: {self._who(r)} did not take it: reports version "
                                      f"{rep['version']}, {rep['buckets']}/{len(buckets)} buckets, checksum {rep['checksum']} "
                                      f"(sent {sums}){': ' + rep['error'] if rep.get('error') else ''}")
        if self._shared and self._shared.startswith("/dev/shm"):
            os.unlink(self._shared)                                       # every engine has mapped it
            self._shared = "unlinked:" + self._shared
        return SyncReport(version, self.transport, dtype, len(buckets), len(params), total, time.perf_counter() - start, peak)

    def _wait_for(self, key: str, version: int, what: str) -> str:
        try:
            return self._get(key).decode()
        except Exception as e:  # noqa: BLE001 - the store's timeout (DistStoreError) or a closed connection
            self.broken = f"v{version}: no {key}"
            r = int(key.rsplit("/", 1)[1])
            raise WeightSyncError(f"weight sync of policy v{version}: {self._who(r)} did not {what} within "
                                  f"{self.timeout_s:g} s ({type(e).__name__}); is it alive?") from e

    def _behind(self, s: str, n: int, version: int) -> str:
        """Which engines fell behind: dead (a same-node member whose process is gone) or, across nodes,
        those with the fewest buckets applied (per-bucket counters in the store)."""
        got = {}
        for r in range(1, self.world_size):
            with contextlib.suppress(Exception):
                got[r] = self.store.add(f"{s}/progress/{r}", 0)
        local = [r for r in range(1, self.world_size) if self.members[r]["host"] == socket.gethostname()]
        # a killed peer's sockets close while its process is still exiting: give it a moment to be gone
        deadline = time.monotonic() + (DEATH_GRACE_S if local else 0)
        while not (dead := [r for r in local if not _alive(self.members[r]["pid"])]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if dead:
            return "; ".join(f"{self._who(r)} is dead after applying {got.get(r, '?')}/{n} buckets of v{version}" for r in dead)
        low = min(got.values(), default=-1)
        return "; ".join(f"{self._who(r)} applied {got[r]}/{n} buckets of v{version}" for r in got if got[r] == low) + \
            " (furthest behind: dead or stuck)"

    def _sender_buffer(self, nbytes: int) -> torch.Tensor:
        """The bucket buffer, reused: plain memory (broadcast), a file in /dev/shm (shm, a new one when a
        sync needs more room) or a CUDA buffer (cuda_ipc)."""
        if self.transport != "shm":
            return self._buffer(nbytes)
        if self._buf is None or self._buf.numel() < nbytes:
            self._unlink()
            path = f"/dev/shm/flyroll-wsync-{os.getpid()}-{id(self):x}-{self.seq}"
            with open(path, "wb") as f:
                f.truncate(nbytes)
            self._buf, self._shared = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8), path
        return self._buf

    def _share(self, buf: torch.Tensor) -> str:
        """Where receivers find the sender's bucket buffer: a /dev/shm path or a pickled CUDA IPC handle."""
        if self.transport == "cuda_ipc":                                 # code path present, not run in CI
            from torch.multiprocessing.reductions import reduce_tensor

            if self._shared is None or self._shared_for is not buf:
                self._shared, self._shared_for = pickle.dumps(reduce_tensor(buf)).hex(), buf
            return self._shared
        return self._shared.removeprefix("unlinked:")

    # ---------------------------------------------------------------- receivers (ranks 1..N)
    def receive(self, engine: WeightReceiver, on_bucket=None) -> int:
        """Take the next sync into `engine` in place; returns the version it now serves. `on_bucket(i)` is
        called after bucket i is applied (tests use it to die mid-sync)."""
        self._check_usable()
        if self.rank == 0:
            raise RuntimeError("receive on rank 0: rank 0 sends, ranks 1..N receive")
        self.seq += 1
        s, r = f"s{self.seq}", self.rank
        try:
            plan = json.loads(self._get(f"{s}/plan"))
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"{self.member}: no sync plan from the trainer within {self.timeout_s:g} s") from e
        version, wire, buckets = plan["version"], SYNC_DTYPES[plan["dtype"]], plan["buckets"]
        applied, sums, name = 0, 0, type(engine).__name__
        answer = self._check_plan(engine, plan)
        self.store.set(f"{s}/ack/{r}", answer)
        try:
            go = self._get(f"{s}/go").decode()
        except Exception as e:  # noqa: BLE001
            self.broken = f"v{version}: no go"
            raise WeightSyncError(f"{self.member}: the trainer did not start the sync of v{version} within {self.timeout_s:g} s") from e
        if go != "go":  # nothing moved: the engine keeps serving its version, the group stays usable
            raise ValueError(f"{self.member} ({name}): weight sync of policy v{version} refused, the engine keeps "
                             f"v{engine.version}: {answer if answer != 'ok' else 'another engine refused it'}")
        try:
            buf = self._buffer(max(bucket_nbytes(b, wire) for b in buckets)) if self.transport == "broadcast" \
                else self._map(plan["shared"])
            for i, bucket in enumerate(buckets):
                n = bucket_nbytes(bucket, wire)
                if self.transport == "broadcast":
                    self._collective("broadcast", buf[:n])
                else:
                    signal = torch.zeros(2, dtype=torch.int64)
                    self._collective("broadcast", signal)                 # bucket i is in the shared buffer
                    if int(signal[0]) != i:
                        raise WeightSyncError(f"expected bucket {i} of v{version}, was signalled {int(signal[0])}")
                sums += checksum(buf[:n])
                engine.update_weights(unpack(buf[:n], bucket, wire), source=f"weight sync v{version} bucket {i}", partial=True)
                if self.transport != "broadcast":
                    self._collective("allreduce", signal)                 # copied: the sender may refill the buffer
                applied = i + 1
                self.store.add(f"{s}/progress/{r}", 1)
                if on_bucket is not None:
                    on_bucket(i)
            engine.finish_weight_update(version)
        except Exception as e:  # noqa: BLE001 - the sender or another member is gone, or the engine refused a bucket
            self.broken = f"v{version}: {e}"
            with contextlib.suppress(Exception):
                self.store.set(f"{s}/done/{r}", json.dumps({"version": engine.version, "buckets": applied, "checksum": sums,
                                                            "error": f"{type(e).__name__}: {str(e)[:300]}"}))
            raise WeightSyncError(f"{self.member} ({name}): weight sync of policy v{version} failed after {applied}/"
                                  f"{len(buckets)} buckets; the engine refuses to generate until it gets a full update "
                                  f"({type(e).__name__}: {str(e)[:200]})") from e
        self.store.set(f"{s}/done/{r}", json.dumps({"version": engine.version, "buckets": applied, "checksum": sums}))
        return engine.version

    def _check_plan(self, engine: WeightReceiver, plan: dict) -> str:
        """"ok", or why this engine cannot take the plan (dtype, names, shapes)."""
        where = f"{type(engine).__name__} serving v{engine.version}"
        want = SYNC_DTYPES[plan["dtype"]]
        if engine.weight_dtype() != want:
            return (f"{where} holds {engine.weight_dtype()} weights and cannot take a {want} sync (set the sync dtype "
                    f"to the generation side's, {str(engine.weight_dtype()).removeprefix('torch.')})")
        spec = engine.weight_spec()
        given = {name: tuple(shape) for b in plan["buckets"] for name, shape, _ in b}
        unknown = [n for n in given if n not in spec]
        bad = [f"{n} {list(given[n])} != {list(spec[n][0])}" for n in given if n in spec and given[n] != tuple(spec[n][0])]
        missing = [n for n, (_, required) in spec.items() if required and n not in given]
        if unknown or bad or missing:
            lora = " (LoRA adapter weights: merge them, engines.training.lora.merged_state_dict)" if any(".lora_" in n for n in unknown) else ""
            return f"{where}: weights do not match: unknown={unknown[:4]}{lora} shape={bad[:4]} missing={missing[:4]}"
        return "ok"

    def _map(self, shared: str) -> torch.Tensor:
        if self._shared != shared:
            if self.transport == "cuda_ipc":                              # code path present, not run in CI
                fn, args = pickle.loads(bytes.fromhex(shared))
                self._buf = fn(*args)
            else:
                self._buf = torch.from_file(shared, shared=True, size=os.path.getsize(shared), dtype=torch.uint8)
            self._shared = shared
        return self._buf

    def _unlink(self) -> None:
        if self.rank == 0 and self._shared and self._shared.startswith("/dev/shm") and os.path.exists(self._shared):
            os.unlink(self._shared)

    def close(self) -> None:
        """Leave the group (the shm file, if still linked, goes; the sender's TCPStore closes with it)."""
        self._unlink()
        self.pg, self._buf = None, None

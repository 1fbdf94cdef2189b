"""CUDA-IPC bucketed refit between two processes on one GPU, against the device's copy bandwidth.

The colocated-refit transport with torch alone: a "trainer" process holds the weights, an
"engine" process holds its own copy of every parameter; weights move through CUDA IPC in
buckets, only metadata (names, offsets) goes over a pipe. Two shapes are measured:

- ``flat``: the trainer keeps its parameters as views into bucket-sized flat buffers (as
  Megatron-style contiguous parameter buffers do); each flat buffer is shared once (its IPC
  handle is cached across refits) and the engine copies its parameters straight out of it —
  one device copy per byte.
- ``packed``: scattered trainer tensors are packed into two reused staging buckets (double
  buffered, so packing bucket k+1 overlaps unpacking bucket k) — two copies per byte.

- ``nemo_gen_ipc``: the shipped transport (``nemo_gen.vllm_ext.cuda_ipc``) on scattered tensors
  (each its own allocation, as a torch module's parameters are): every storage's handle
  exported and opened once, a refit sends metadata and the engine copies out of the trainer's
  memory — one device copy per byte, like ``flat``, whatever the trainer's layout.
- ``vllm-packed``: vLLM's own packed CUDA-IPC data path (``packed_ipc_producer`` /
  ``packed_ipc_consumer`` from ``vllm/distributed/weight_transfer/packed_tensor.py``, what a
  fleet started with ``refit.backend: ipc`` receives through vLLM's ``IPCWeightTransferEngine``):
  one reused buffer, the producer waits for each chunk to be consumed, the consumer clones
  every tensor before the model's loader copies it into place — three copies per byte, serial.
  That file is pure torch: where vLLM is not installed, point ``NEMO_GEN_VLLM_PACKED_TENSOR``
  at a copy of it.

All are reported as (bytes / refit seconds) / (device copy bandwidth), the copy bandwidth
measured in the same run as ``dst.copy_(src)`` of the same byte count. Target for ``flat``:
>= 0.7. Run on a GPU machine: ``python -m bench cuda_ipc_refit --gb 8``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from bench.lib.result import write_result
from bench.lib.stats import check, verdict


def make_shapes(total_bytes: int, elem: int = 2) -> list[tuple[int, int]]:
    """A transformer-like mix: large square/rectangular matrices and small vectors."""
    shapes, used, i = [], 0, 0
    pattern = [(4096, 4096), (4096, 14336), (14336, 4096), (4096, 1), (1024, 4096)]
    while used < total_bytes:
        r, c = pattern[i % len(pattern)]
        shapes.append((r, c))
        used += r * c * elem
        i += 1
    return shapes


def vllm_packed_tensor():
    """vLLM's packed-tensor module: the installed one, or the copy NEMO_GEN_VLLM_PACKED_TENSOR names."""
    import importlib.util
    import os

    try:
        from vllm.distributed.weight_transfer import packed_tensor

        return packed_tensor
    except ImportError:
        path = os.environ.get("NEMO_GEN_VLLM_PACKED_TENSOR")
        if not path:
            return None
        spec = importlib.util.spec_from_file_location("vllm_packed_tensor", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


def engine(conn, shapes, dtype_name):
    """The receiving process: its own parameters; copies them out of shared buckets."""
    import torch

    dtype = getattr(torch, dtype_name)
    torch.cuda.set_device(0)
    params = [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]
    stream = torch.cuda.Stream()
    buckets = {}
    packed_tensor = vllm_packed_tensor()
    importer = packed_tensor.PackedBufferImporter() if packed_tensor else None
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        kind = msg[0]
        if kind == "vllm_chunk":  # ("vllm_chunk", PackedIpcChunk fields, [param index per name])
            _, chunk, indices = msg
            weights = packed_tensor.packed_ipc_consumer(
                ipc_handle=chunk["ipc_handle"], names=chunk["names"], shapes=chunk["shapes"],
                dtype_names=chunk["dtype_names"], tensor_sizes=chunk["tensor_sizes"], device_index=0,
                importer=importer,
            )
            for idx, (_, tensor) in zip(indices, weights):  # what the model's weight loaders do
                params[idx].copy_(tensor)
            torch.cuda.synchronize()
            conn.send(("done", None))
            continue
        if kind == "ipc_info":  # ("ipc_info", IpcSender.update_info(...), [param index per name])
            from nemo_gen.vllm_ext.cuda_ipc import IpcReceiver

            _, info, indices = msg
            receiver = buckets.setdefault("receiver", IpcReceiver(torch.device("cuda", 0)))
            for idx, (_, view) in zip(indices, receiver.tensors(info)):
                params[idx].copy_(view)
            torch.cuda.synchronize()
            conn.send(("done", None))
            continue
        if kind == "vllm_end":
            importer.close()
            continue
        if kind == "share":  # ("share", bucket_id, handle tensor)
            buckets[msg[1]] = msg[2]
            continue
        # ("load", bucket_id, [(param_index, byte_offset, nbytes)], event, ack)
        _, bucket_id, entries, event, ack = msg
        buf = buckets[bucket_id]
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            # Contiguous byte ranges: each copy_ is a device memcpy (a byte-wise _foreach_copy_
            # kernel measured ~1.5x slower here).
            for idx, off, nbytes in entries:
                params[idx].view(-1).view(torch.uint8).copy_(buf[off : off + nbytes], non_blocking=True)
        if ack:  # the sender needs this bucket back (or the refit is complete)
            stream.synchronize()
            conn.send(("done", bucket_id))
    conn.send(("checksum", float(sum(p.float().sum().item() for p in params[:4]))))


def run(args):
    import torch
    import torch.multiprocessing as mp

    dtype = getattr(torch, args.dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    shapes = make_shapes(int(args.gb * 1e9), elem)
    total = sum(r * c * elem for r, c in shapes)
    bucket_bytes = int(args.bucket_mb * 2**20)

    # Device copy bandwidth: one dst.copy_(src) of the same total size.
    src = torch.randn(total // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_times = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        copy_times.append(time.perf_counter() - t0)
    copy_bw = total / statistics.median(copy_times)
    del src, dst

    # Trainer weights as views into bucket-sized flat buffers.
    flat_buffers, views, cursor, layout = [], [], bucket_bytes, []
    for idx, (r, c) in enumerate(shapes):
        nbytes = r * c * elem
        if cursor + nbytes > bucket_bytes or not flat_buffers:
            flat_buffers.append(torch.empty(max(bucket_bytes, nbytes), dtype=torch.uint8, device="cuda"))
            layout.append([])
            cursor = 0
        buf = flat_buffers[-1]
        view = buf[cursor : cursor + nbytes].view(dtype).view(r, c)
        view.normal_()
        views.append(view)
        layout[-1].append((idx, cursor, nbytes))
        cursor = (cursor + nbytes + 255) // 256 * 256
    torch.cuda.synchronize()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child, shapes, args.dtype))
    proc.start()
    assert parent.recv() == "ready"

    results = {"bytes": total, "copy_gb_per_s": copy_bw / 1e9, "bucket_mb": args.bucket_mb}

    # flat: share every flat buffer once, then each refit sends only metadata.
    for b, buf in enumerate(flat_buffers):
        parent.send(("share", b, buf))
    flat_times = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # The flat buffers are never reused mid-refit: one event, one acknowledgement at the end.
        event = torch.cuda.Event(interprocess=True)
        event.record()
        for b, entries in enumerate(layout):
            parent.send(("load", b, entries, event, b == len(layout) - 1))
        parent.recv()
        flat_times.append(time.perf_counter() - t0)
    flat_s = statistics.median(flat_times[1:] or flat_times)  # the first maps the handles
    results["flat_s"] = flat_s
    results["flat_fraction_of_copy"] = (total / flat_s) / copy_bw

    # packed: scattered tensors packed into two reused staging buckets.
    scattered = [v.clone() for v in views]
    staging = [torch.empty(bucket_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    for k, buf in enumerate(staging):
        parent.send(("share", 1000 + k, buf))
    groups, cur, size = [], [], 0
    for idx, (r, c) in enumerate(shapes):
        nbytes = r * c * elem
        if cur and size + nbytes > bucket_bytes:
            groups.append(cur)
            cur, size = [], 0
        cur.append((idx, size, nbytes))
        size = (size + nbytes + 255) // 256 * 256
    groups.append(cur)
    packed_times = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        busy = [False, False]
        for g, entries in enumerate(groups):
            k = g % 2
            if busy[k]:
                kind, _ = parent.recv()  # in order: the oldest outstanding bucket is done
                busy[k] = False
            for idx, off, nbytes in entries:
                staging[k][off : off + nbytes].copy_(scattered[idx].view(-1).view(torch.uint8), non_blocking=True)
            event = torch.cuda.Event(interprocess=True)
            event.record()
            parent.send(("load", 1000 + k, entries, event, True))
            busy[k] = True
        for k in (0, 1):
            if busy[k]:
                parent.recv()
        packed_times.append(time.perf_counter() - t0)
    packed_s = statistics.median(packed_times[1:] or packed_times)
    results["packed_s"] = packed_s
    results["packed_fraction_of_copy"] = (total / packed_s) / copy_bw

    # nemo_gen_ipc: the shipped sender/receiver on the scattered tensors.
    from nemo_gen.vllm_ext.cuda_ipc import IpcSender

    sender = IpcSender()
    named = [(f"p{i}", t) for i, t in enumerate(scattered)]
    ipc_times = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        info = sender.update_info(named)
        parent.send(("ipc_info", info, list(range(len(named)))))
        parent.recv()
        ipc_times.append(time.perf_counter() - t0)
    ipc_s = statistics.median(ipc_times[1:] or ipc_times)  # the first opens the handles
    results["nemo_gen_ipc_s"] = ipc_s
    results["nemo_gen_ipc_first_s"] = ipc_times[0]
    results["nemo_gen_ipc_fraction_of_copy"] = (total / ipc_s) / copy_bw

    # vllm-packed: vLLM's IPC engine's data path, chunk by chunk, each acknowledged before the
    # producer resumes (as IPCTrainerWeightTransferEngine does with its client call).
    packed_tensor = vllm_packed_tensor()
    if packed_tensor is not None:
        from dataclasses import asdict

        uuid = str(torch.cuda.get_device_properties(0).uuid)
        index = {f"p{i}": i for i in range(len(shapes))}
        vllm_times = []
        for _ in range(args.rounds):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for chunk in packed_tensor.packed_ipc_producer(
                iter((f"p{i}", t) for i, t in enumerate(scattered)), uuid, lambda item: item[1],
                buffer_size_bytes=bucket_bytes,
            ):
                parent.send(("vllm_chunk", asdict(chunk), [index[n] for n in chunk.names]))
                parent.recv()
            parent.send(("vllm_end",))
            vllm_times.append(time.perf_counter() - t0)
        vllm_s = statistics.median(vllm_times[1:] or vllm_times)
        results["vllm_packed_s"] = vllm_s
        results["vllm_packed_fraction_of_copy"] = (total / vllm_s) / copy_bw

    parent.send("stop")
    _, checksum = parent.recv()
    expected = float(sum(v.float().sum().item() for v in scattered[:4]))
    results["checksum_ok"] = abs(checksum - expected) <= 1e-3 * max(1.0, abs(expected))
    proc.join(timeout=60)
    return results


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gb", type=float, default=8.0, help="weight bytes to refit")
    p.add_argument("--bucket-mb", type=float, default=1024)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args(argv)
    r = run(args)
    print(f"weights: {r['bytes'] / 1e9:.2f} GB {args.dtype}, buckets {args.bucket_mb:.0f} MB")
    print(f"device copy bandwidth (dst.copy_(src)): {r['copy_gb_per_s']:.0f} GB/s")
    print(f"flat buffers, shared once:   {r['flat_s'] * 1e3:.1f} ms -> {r['bytes'] / r['flat_s'] / 1e9:.0f} GB/s = "
          f"{r['flat_fraction_of_copy']:.2f} of copy (target >= 0.7)")
    print(f"packed, double-buffered:     {r['packed_s'] * 1e3:.1f} ms -> {r['bytes'] / r['packed_s'] / 1e9:.0f} GB/s = "
          f"{r['packed_fraction_of_copy']:.2f} of copy (two copies per byte: ceiling 0.5)")
    print(f"nemo_gen_ipc (shipped, scattered): {r['nemo_gen_ipc_s'] * 1e3:.1f} ms -> "
          f"{r['bytes'] / r['nemo_gen_ipc_s'] / 1e9:.0f} GB/s = {r['nemo_gen_ipc_fraction_of_copy']:.2f} of copy "
          f"(target >= 0.7; first refit, opening the handles: {r['nemo_gen_ipc_first_s'] * 1e3:.1f} ms)")
    if "vllm_packed_s" in r:
        print(f"vLLM's packed IPC (ipc backend): {r['vllm_packed_s'] * 1e3:.1f} ms -> "
              f"{r['bytes'] / r['vllm_packed_s'] / 1e9:.0f} GB/s = {r['vllm_packed_fraction_of_copy']:.2f} of copy "
              "(three copies per byte, chunks serial)")
    else:
        print("vLLM's packed IPC: not measured (no vllm, NEMO_GEN_VLLM_PACKED_TENSOR unset)")
    print(f"engine received the trainer's values: {r['checksum_ok']}")
    return write_result(args.json, "cuda_ipc_refit", args, r, {
        "nemo_gen_ipc": verdict(r["nemo_gen_ipc_fraction_of_copy"], 0.7, higher_is_better=True),
        "checksum": check(bool(r["checksum_ok"]))})

"""All-reduce time by message size on this host's GPUs: NCCL, and torch's one-shot
symmetric-memory all-reduce (what `--all-reduce-oneshot-max-kb` uses), each timed over CUDA
graph replays as a decode step runs them. Tells whether NCCL rides NVLink here (run with
NCCL_DEBUG=INFO and look for "via P2P" against "via SHM").

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc-per-node 2 benchmarks/allreduce_probe.py
"""

import os

import torch
import torch.distributed as dist

SIZES_KB = (8, 64, 1024, 4096, 32768)
REPLAYS = 50


def time_graph(fn, device) -> float:
    """Microseconds per call of fn, captured 10 times in one graph and replayed."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    us = start.elapsed_time(end) * 1000 / (REPLAYS * 10)
    graph.reset()  # before the process group goes (pytorch/pytorch#115388)
    return us


def main():
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[name] = value
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    rows = []
    oneshot = None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(group.group_name)
        buffer = symm_mem.empty(max(SIZES_KB) * 1024, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
        oneshot = buffer
    except Exception as e:  # noqa: BLE001 - reported, the NCCL figures still come
        if rank == 0:
            print(f"symmetric memory unavailable: {e}")
    for kb in SIZES_KB:
        x = torch.randn(kb * 512, dtype=torch.bfloat16, device=device)  # kb KiB of bf16
        nccl_us = time_graph(lambda: dist.all_reduce(x), device)
        one_us = None
        if oneshot is not None:
            staged = oneshot[:x.numel() * 2].view(torch.bfloat16)

            def one():
                staged.copy_(x)
                torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", group.group_name)

            try:
                one_us = time_graph(one, device)
            except Exception as e:  # noqa: BLE001
                if rank == 0:
                    print(f"one-shot all-reduce failed at {kb} KiB: {e}")
                oneshot = None
        rows.append((kb, nccl_us, one_us))
    if rank == 0:
        print(f"all-reduce over {world} GPUs, bf16, timed in CUDA graphs")
        print("| size | NCCL us | NCCL bus GB/s | one-shot us |")
        print("|---|---|---|---|")
        for kb, nccl_us, one_us in rows:
            bus = 2 * (world - 1) / world * kb * 1024 / (nccl_us * 1e-6) / 1e9
            one = f"{one_us:.1f}" if one_us is not None else "n/a"
            print(f"| {kb} KiB | {nccl_us:.1f} | {bus:.1f} | {one} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""CUDA graphs over the executor: capture each graph of a Program once, then replay it.

A Program is traced at one batch (trace option `batch`, 1 for lingc's product), so one CUDA graph per program
graph covers every (program, padded batch) pair it serves. Every input of a graph is a persistent buffer
(`executor.Buffers`), so a replay reads whatever the host last wrote there: host-fed inputs, the metadata the
`capture_metadata` group refills in-graph from slots/page_table/seq_len, and the state pools. Capture needs a
warm-up run per graph first (Triton compiles, cuBLAS sets up), which writes to the state buffers; `capture`
therefore zeroes every buffer afterwards, so it must run before any request holds state (Engine does it at
start-up). All graphs share one memory pool: they replay one after another on one stream.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from lingc.runtime.executor import Executor


class CudaGraphs:
    """Captured graphs of an Executor on a CUDA device; `run(name)` replays (or runs eagerly if not captured)."""

    def __init__(self, exe: Executor):
        if exe.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA executor, got device {exe.device}")
        self.exe = exe
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[str, Any] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, names: Iterable[str], warmup: int = 2) -> None:
        names = list(names)
        stream = torch.cuda.Stream(self.exe.device)
        stream.wait_stream(torch.cuda.current_stream(self.exe.device))
        with torch.cuda.stream(stream):
            for _ in range(warmup):
                for name in names:
                    self.exe.run(name)
        torch.cuda.current_stream(self.exe.device).wait_stream(stream)
        torch.cuda.synchronize(self.exe.device)
        for name in names:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[name] = self.exe.run(name)
            self.graphs[name] = graph
        torch.cuda.synchronize(self.exe.device)
        for buf in self.exe.buffers.tensors.values():     # warm-up wrote state; start clean
            buf.zero_()

    def run(self, name: str) -> Any:
        graph = self.graphs.get(name)
        if graph is None:
            return self.exe.run(name)
        graph.replay()
        return self.outputs[name]

"""What one simulation takes (:class:`SimConfig`: hardware, model, engine settings) and
what it measures (:class:`SimResult`); :mod:`tieredkv.sim.engine` runs it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import numpy.typing as npt

from .costmodel import CostModel, get_gpu, get_model

if TYPE_CHECKING:
    from .workloads import WorkloadSpec

__all__ = ["SimConfig", "SimResult", "measure", "steady_state"]


class SimConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Hardware, model and engine settings of a simulation.

    :param model: model preset (:data:`~tieredkv.sim.costmodel.MODELS`)
    :param gpu: GPU preset (:data:`~tieredkv.sim.costmodel.GPUS`)
    :param host_gb: host memory for history KV, 10^9 bytes
    :param ssd_gbps: SSD bandwidth, 10^9 bytes/s (reads and writes share it)
    :param ssd_latency: fixed seconds per SSD transfer
    :param history_cap: history tokens kept per conversation at most (the paper: 2048)
    :param token_budget: tokens one prefill iteration computes at most
    :param max_seqs: requests in the running batch at most
    :param mfu: fraction of the GPU's tensor peak a prefill reaches (0.35: fitted, with
        ``hbm_efficiency``, to the paper's supported rates; :mod:`tieredkv.sim.calibration`)
    :param hbm_efficiency: fraction of HBM bandwidth a decode iteration reaches (0.65: fitted)
    :param link_efficiency: fraction of the PCIe spec a host -> GPU copy reaches
    :param gpu_memory_utilization: fraction of GPU memory for weights and K/V
    :param iteration_overhead: fixed seconds per engine iteration
    :param queue_window: scheduler queue length published on the channel (``view.waiting``)
    :param write_buffer_gb: host memory buffering asynchronous SSD writes, 10^9 bytes
        (systems with ``background_writes``): writes beyond it wait in line with the loads
    :param warmup: turns whose trace time is earlier are run but not counted
    :param until: turns whose trace time is later are run but not counted (``None``: all)
    """

    model: str = "opt-13b"
    gpu: str = "a800"
    host_gb: float = 200.0
    ssd_gbps: float = 1.5
    ssd_latency: float = 0.0
    history_cap: int = 2048
    token_budget: int = 8192
    max_seqs: int = 256
    mfu: float = 0.35
    hbm_efficiency: float = 0.65
    link_efficiency: float = 0.8
    gpu_memory_utilization: float = 0.9
    iteration_overhead: float = 0.002
    queue_window: int = 30
    write_buffer_gb: float = 4.0
    warmup: float = 0.0
    until: float | None = None

    def __post_init__(self) -> None:
        if self.host_gb <= 0 or self.ssd_gbps <= 0 or self.ssd_latency < 0:
            raise ValueError("host_gb and ssd_gbps must be positive, ssd_latency >= 0")
        if self.write_buffer_gb < 0:
            raise ValueError(f"write_buffer_gb must be >= 0 (got {self.write_buffer_gb})")
        if self.history_cap < 1 or self.token_budget < 1 or self.max_seqs < 1:
            raise ValueError("history_cap, token_budget and max_seqs must be >= 1")

    def cost_model(self) -> CostModel:
        """The :class:`~tieredkv.sim.costmodel.CostModel` these settings describe."""
        return CostModel(
            get_model(self.model),
            get_gpu(self.gpu),
            mfu=self.mfu,
            hbm_efficiency=self.hbm_efficiency,
            link_efficiency=self.link_efficiency,
            gpu_memory_utilization=self.gpu_memory_utilization,
            iteration_overhead=self.iteration_overhead,
        )


class SimResult(msgspec.Struct, frozen=True, kw_only=True):
    """Metrics of one simulation (times in seconds; counted turns only).

    :param system: the system's name
    :param turns: turns counted
    :param users: distinct users simulated
    :param latency_mean: response latency (arrival to last token), mean
    :param latency_p50: its median
    :param latency_p90: its 90th percentile
    :param latency_p95: its 95th percentile
    :param latency_p99: its 99th percentile
    :param queueing_mean: arrival to the start of the turn's prefill, mean
    :param queueing_p90: its 90th percentile
    :param ttft_mean: time to first token, mean
    :param ttft_p99: its 99th percentile
    :param accesses: counted turns with history (each reads its history KV)
    :param host_hits: of those, the ones whose KV was in host memory at arrival and was
        read from there (a KV evicted while its turn queued, and read back from SSD when
        the turn ran, is a miss)
    :param ssd_read_bytes: bytes loaded from SSD (whole run)
    :param ssd_write_bytes: bytes written to SSD (whole run)
    :param recomputed_tokens: history tokens recomputed instead of loaded (whole run)
    :param gpu_busy: fraction of the run (first arrival to last token) the GPU computed
    :param makespan: first arrival to last token
    :param load_time_cv: coefficient of variation of the KV load time of the accesses
        (host hit: PCIe; miss: SSD then PCIe)
    :param evictions: sessions moved out of host memory to make room
    :param direct_loads: SSD loads that found no room in host memory (the KV went from SSD
        to the GPU through a staging buffer, and was not admitted to host memory)
    :param predicted: sessions brought into host memory by predictive prefetch
    """

    system: str
    turns: int
    users: int
    latency_mean: float
    latency_p50: float
    latency_p90: float
    latency_p95: float
    latency_p99: float
    queueing_mean: float
    queueing_p90: float
    ttft_mean: float
    ttft_p99: float
    accesses: int
    host_hits: int
    ssd_read_bytes: int
    ssd_write_bytes: int
    recomputed_tokens: int
    gpu_busy: float
    makespan: float
    load_time_cv: float
    evictions: int
    direct_loads: int
    predicted: int = 0

    @property
    def host_hit_ratio(self) -> float:
        """Host hits over accesses (0 when no access was counted)."""
        return self.host_hits / self.accesses if self.accesses else 0.0


def measure(
    system: str,
    counted: npt.NDArray[np.bool_],
    *,
    arrival: npt.NDArray[np.float64],
    start: npt.NDArray[np.float64],
    first_token: npt.NDArray[np.float64],
    finish: npt.NDArray[np.float64],
    load_times: Sequence[float],
    span: tuple[float, float],
    users: int,
    accesses: int,
    host_hits: int,
    ssd_read_bytes: int,
    ssd_write_bytes: int,
    recomputed_tokens: int,
    gpu_seconds: float,
    evictions: int,
    direct_loads: int,
    predicted: int,
) -> SimResult:
    """The :class:`SimResult` of a run from its per-turn times (``counted`` selects the
    turns counted) and its totals; ``span`` is (first arrival, last token)."""
    latency = (finish - arrival)[counted]
    queueing = (start - arrival)[counted]
    ttft = (first_token - arrival)[counted]

    def pct(a: npt.NDArray[np.float64], q: float) -> float:
        return float(np.percentile(a, q)) if len(a) else 0.0

    def mean(a: npt.NDArray[np.float64]) -> float:
        return float(a.mean()) if len(a) else 0.0

    loads = np.asarray(load_times)
    cv = float(loads.std() / loads.mean()) if len(loads) and loads.mean() > 0 else 0.0
    makespan = span[1] - span[0]
    return SimResult(
        system=system,
        turns=int(counted.sum()),
        users=users,
        latency_mean=mean(latency),
        latency_p50=pct(latency, 50),
        latency_p90=pct(latency, 90),
        latency_p95=pct(latency, 95),
        latency_p99=pct(latency, 99),
        queueing_mean=mean(queueing),
        queueing_p90=pct(queueing, 90),
        ttft_mean=mean(ttft),
        ttft_p99=pct(ttft, 99),
        accesses=accesses,
        host_hits=host_hits,
        ssd_read_bytes=ssd_read_bytes,
        ssd_write_bytes=ssd_write_bytes,
        recomputed_tokens=recomputed_tokens,
        gpu_busy=gpu_seconds / makespan if makespan > 0 else 0.0,
        makespan=makespan,
        load_time_cv=cv,
        evictions=evictions,
        direct_loads=direct_loads,
        predicted=predicted,
    )


def steady_state(config: SimConfig, workload: WorkloadSpec) -> SimConfig:
    """``config`` counting only the steady state of a generated workload
    (:data:`~tieredkv.sim.workloads.GENERATED_KINDS`: turns arriving from 37.5% of its
    minutes of arrivals to their end, not the ramp-up and -down), unless ``config`` already
    sets a window; a trace counts all."""
    from .workloads import GENERATED_KINDS

    if workload.kind in GENERATED_KINDS and config.warmup == 0 and config.until is None:
        end = workload.minutes * 60.0
        return msgspec.structs.replace(config, warmup=0.375 * end, until=end)
    return config

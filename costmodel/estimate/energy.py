"""Cost and energy of one training step, from an `Estimate`, its strategy and the cluster.

Cost: the GPUs are rented for the whole step, busy or not, so
    cost per step (USD) = step_time_s * num_gpus * gpu_hour_price_usd / 3600
(price per GPU-hour, as cloud providers list it; every GPU of the strategy is billed).

Energy: a two-state power model per device, E = P_busy * t_busy + P_idle * t_idle, with
t_idle = step - t_busy, summed over the GPUs. This is the linear busy/idle model behind
the "energy bloat" analysis of Chung et al., "Perseus: Reducing Energy Bloat in Large
Model Training" (SOSP 2024, arXiv:2312.06902): a GPU waiting in a pipeline bubble or for
the slowest stage still draws idle power. MLPerf Power (Tschand et al. 2024,
arXiv:2410.12032) measures the same quantity at the wall for the whole system; here only
the accelerators are counted (no CPUs, NICs, cooling).

Busy time of pipeline rank r (every one of its dp x tp devices):
    busy_r = num_microbatches * rank_time_s[r] + tail,   tail = exposed DP sync + optimizer step
rank_time_s[r] is one micro-batch's compute, recomputation and tp/ep/pp/dp communication
on rank r (costmodel.estimate.uniform.rank_work); the tail is what the step adds after the
pipeline, charged to every rank (the estimate keeps its maximum over ranks, so this
slightly overcounts ranks other than the slowest). Communication counts as busy: NCCL
kernels occupy SMs and HBM while they run, so the board sits well above idle; charging
it at TDP is an upper bound. The pipeline bubble, and the wait of faster ranks for the
slowest one, count as idle. busy_r is capped at the step time.
"""

from __future__ import annotations

from dataclasses import dataclass

from costmodel.estimate.breakdown import Estimate
from costmodel.estimate.mixed import device_groups
from costmodel.specs import ClusterSpec, MixedClusterSpec
from costmodel.specs.loading import SpecError
from costmodel.strategy import Strategy

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class CostEnergy:
    """One step's price and energy; a figure is None when the spec lacks its inputs."""

    cost_per_step_usd: float | None
    energy_per_step_j: float | None       # all GPUs of the strategy
    average_power_w: float | None         # per device, mean over the devices and the step
    max_device_power_w: float | None      # the busiest device, averaged over the step
    rank_busy_s: tuple[float, ...]        # per pipeline rank (or replica), seconds busy in one step

    def as_dict(self) -> dict:
        """The figures that are set (a plan document carries only those)."""
        out = {k: v for k, v in (("cost_per_step_usd", self.cost_per_step_usd),
                                 ("energy_per_step_j", self.energy_per_step_j),
                                 ("average_power_w", self.average_power_w),
                                 ("max_device_power_w", self.max_device_power_w)) if v is not None}
        if out:
            out["rank_busy_s"] = list(self.rank_busy_s)
        return out


def _groups(cluster) -> tuple[ClusterSpec, ...]:
    return cluster.groups if isinstance(cluster, MixedClusterSpec) else (cluster,)


def has_power(cluster: ClusterSpec | MixedClusterSpec) -> bool:
    return all(g.gpu.busy_power_w is not None and g.gpu.idle_power_w is not None for g in _groups(cluster))


def has_price(cluster: ClusterSpec | MixedClusterSpec) -> bool:
    return all(g.gpu_hour_price_usd is not None for g in _groups(cluster))


def require(cluster: ClusterSpec | MixedClusterSpec, *, price: bool = False, power: bool = False, why: str = "") -> None:
    """Raise SpecError naming the first missing field that `why` needs."""
    for g in _groups(cluster):
        if price and g.gpu_hour_price_usd is None:
            raise SpecError("cluster.gpu_hour_price_usd",
                            f"missing: {why} needs a price per GPU-hour in the cluster spec ({g.name})")
        if power:
            for key in ("busy_power_w", "idle_power_w"):
                if getattr(g.gpu, key) is None:
                    raise SpecError(f"cluster.gpu.{key}",
                                    f"missing: {why} needs the GPU's {key} in the hardware spec ({g.gpu.name})")


def rank_busy_s(estimate: Estimate, strategy: Strategy, cluster: ClusterSpec | MixedClusterSpec | None = None) -> tuple[float, ...]:
    """Seconds each pipeline rank (each replica, for replica groups) is busy in one
    step (module docstring)."""
    return tuple(busy for _, _, busy in device_groups(cluster, strategy, estimate))


def cost_energy(cluster: ClusterSpec | MixedClusterSpec, strategy: Strategy, estimate: Estimate) -> CostEnergy:
    """Cost and energy of one step, each set of devices priced and powered as its group
    (costmodel.estimate.mixed.device_groups: a pipeline rank's devices, or a replica's)."""
    step, gpus = estimate.step_time_s, strategy.num_gpus
    sets = device_groups(cluster, strategy, estimate)
    busy = tuple(b for _, _, b in sets)
    cost = energy = average = hottest = None
    if has_price(cluster):
        cost = step * sum(n * g.gpu_hour_price_usd for g, n, _ in sets) / SECONDS_PER_HOUR
    if has_power(cluster):
        per_device_j = [b * g.gpu.busy_power_w + (step - b) * g.gpu.idle_power_w for g, _, b in sets]
        energy = sum(n * j for (_, n, _), j in zip(sets, per_device_j))
        average = energy / (gpus * step)
        hottest = max(per_device_j) / step
    return CostEnergy(cost, energy, average, hottest, busy)


def energy_lower_bound_j(cluster: ClusterSpec | MixedClusterSpec, num_gpus: int,
                         step_time_lower_bound_s: float) -> float:
    """A lower bound of the energy of any step at least this long: every device draws at
    least idle power for the whole step (busy_power_w >= idle_power_w, checked on load);
    on a mixed cluster, at least the least idle power of its groups."""
    return num_gpus * min(g.gpu.idle_power_w for g in _groups(cluster)) * step_time_lower_bound_s

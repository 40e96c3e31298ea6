"""Engine load probe: scrape the engine's Prometheus /metrics (SGLang or vLLM names)."""

from __future__ import annotations

import logging

import aiohttp

from pdcoord.load import EngineLoad

log = logging.getLogger(__name__)

# metric name -> field, for both engines' naming schemes
_NAMES = {
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
}


def parse_metrics(text: str) -> EngineLoad:
    """Sum each known metric over its label sets (one engine may expose several series).

    An engine that exports both naming schemes (pdsim does, for either kind of peer router) would be
    counted twice if the families were added up: each field takes the first family that has it,
    SGLang's before vLLM's. Strict handover compares this count with the masters' leases.
    """
    per_metric: dict[str, float] = {}
    seen = False
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ ":
                name_end = i
                break
        name = line[:name_end]
        field = _NAMES.get(name)
        if field is None:
            continue
        try:
            rest = line[line.rindex("}") + 1 :].split() if "}" in line else line.split()[1:]
            value = float(rest[0])
        except (ValueError, IndexError):
            continue
        seen = True
        if field == "kv_usage":
            per_metric[name] = max(per_metric.get(name, 0.0), value)
        else:
            per_metric[name] = per_metric.get(name, 0.0) + value
    sums: dict[str, float] = {}
    for name, field in _NAMES.items():  # dict order: SGLang names first
        if name in per_metric and field not in sums:
            sums[field] = per_metric[name]
    return EngineLoad(
        running=int(sums.get("running", 0)),
        waiting=int(sums.get("waiting", 0)),
        kv_usage=sums.get("kv_usage", 0.0),
        probe_ok=seen,
    )


class LoadProbe:
    def __init__(self, metrics_url: str, session: aiohttp.ClientSession, timeout: float = 0.5) -> None:
        self.url = metrics_url
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._warned = False

    async def sample(self) -> EngineLoad:
        try:
            async with self.session.get(self.url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                sample = parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            if not self._warned:
                log.warning("load probe %s failed: %s", self.url, exc)
                self._warned = True
            return EngineLoad()
        self._warned = False
        return sample


async def fetch_max_running_requests(
    endpoint: str, session: aiohttp.ClientSession, timeout: float = 5.0
) -> int:
    """Read ``max_running_requests`` from the engine's ``GET /get_server_info``."""
    url = endpoint.rstrip("/") + "/get_server_info"
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            info = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise RuntimeError(
            f"--running-max-req-size not given and {url} could not be read ({exc}); "
            "pass --running-max-req-size or make the engine reachable"
        ) from exc
    value = info.get("max_running_requests") if isinstance(info, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RuntimeError(
            f"--running-max-req-size not given and {url} has no positive integer 'max_running_requests' "
            f"(got {value!r}); pass --running-max-req-size"
        )
    return value


class EngineHealth:
    """The agent's verdict on its engine's liveness (pure): ``failures`` failed checks in a row mark it
    down, ``successes`` passed checks in a row mark it up again. It starts up (not yet disproved)."""

    def __init__(self, failures: int = 3, successes: int = 2) -> None:
        if failures < 1 or successes < 1:
            raise ValueError("health thresholds must be at least 1")
        self.failures = failures
        self.successes = successes
        self.up = True
        self.reason = ""  # the last failed check's error, kept while down
        self.fail_streak = 0
        self.ok_streak = 0
        self.checks = 0

    def observe(self, ok: bool, error: str = "") -> bool:
        """Record one check; True when the verdict flipped."""
        self.checks += 1
        if ok:
            self.ok_streak += 1
            self.fail_streak = 0
            if not self.up and self.ok_streak >= self.successes:
                self.up = True
                self.reason = ""
                return True
            return False
        self.fail_streak += 1
        self.ok_streak = 0
        if self.up and self.fail_streak >= self.failures:
            self.up = False
            self.reason = error
            return True
        if not self.up:
            self.reason = error
        return False

    def as_json(self) -> dict[str, object]:
        return {
            "up": self.up,
            "reason": self.reason,
            "consecutive_failures": self.fail_streak,
            "consecutive_successes": self.ok_streak,
            "checks": self.checks,
        }


async def check_health(url: str, session: aiohttp.ClientSession, timeout: float = 1.0) -> str:
    """One liveness check (``GET url``): "" when the engine answered 200, otherwise what went wrong."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            await resp.read()
            if resp.status != 200:
                return f"GET {url}: HTTP {resp.status}"
    except TimeoutError:
        return f"GET {url}: no answer within {timeout:g} s"
    except aiohttp.ClientError as exc:
        return f"GET {url}: {exc or type(exc).__name__}"
    return ""

"""Machine telemetry for the metrics: CPU clock and temperature (psutil), the process's peak
memory.

Laptops that throttle show it here: a falling ``cpu_mhz`` or a rising ``temp_c`` next to a slower
step. Values are ``None`` where the machine exposes nothing (VMs, containers without hwmon).
"""

from __future__ import annotations

import resource

import psutil

# hwmon/thermal driver names that report the CPU package, most specific first.
_CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "acpitz", "x86_pkg_temp")


def cpu_mhz() -> float | None:
    """Current mean CPU clock in MHz, or None when unknown (0 is reported as None)."""
    try:
        freq = psutil.cpu_freq()
    except (OSError, NotImplementedError, RuntimeError):
        return None
    if freq is None or not freq.current:
        return None
    return round(float(freq.current), 1)


def temp_c() -> float | None:
    """Hottest CPU temperature in degrees Celsius, or None when no sensor is exposed."""
    read = getattr(psutil, "sensors_temperatures", None)
    if read is None:
        return None
    try:
        sensors = read()
    except (OSError, NotImplementedError, RuntimeError):
        return None
    if not sensors:
        return None
    for name in _CPU_SENSORS:
        readings = [t.current for t in sensors.get(name, []) if t.current is not None]
        if readings:
            return round(float(max(readings)), 1)
    readings = [t.current for entries in sensors.values() for t in entries if t.current is not None]
    return round(float(max(readings)), 1) if readings else None


def max_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (10^6 bytes; getrusage's ru_maxrss, KiB on
    Linux)."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6, 1)

"""Machine telemetry for the metrics: CPU clock and temperature (psutil), physical cores.

Laptops that throttle show it here: a falling ``cpu_mhz`` or a rising ``temp_c`` next to a slower
step. Values are ``None`` where the machine exposes nothing (VMs, containers without hwmon).
"""

from __future__ import annotations

import os

import psutil

# hwmon/thermal driver names that report the CPU package, most specific first.
_CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "acpitz", "x86_pkg_temp")


def physical_cores() -> int:
    """Physical CPU cores of this machine (logical CPUs when psutil cannot tell)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


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

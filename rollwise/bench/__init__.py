"""`rollwise bench ...`: the benchmarks. What they share lives here."""


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 <= q <= 1) of `values`; NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process `pid` has used so far, from /proc (Linux).
    Raises OSError when the process is gone (or there is no /proc)."""
    import os

    # the command name in parentheses may contain spaces: the fields are after the last ')'
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime

"""The results table (RESULTS.md) from the benchmarks' JSON results: how to read it, the machine,
a summary row per measure and each measure's details."""

from __future__ import annotations

from typing import Any

HOW_TO_READ = """\
## How to read the benchmarks

- **Pairs.** Each benchmark runs its baseline and Stoker (the candidate) as pairs: run *i* of
  each, back to back, the order alternating (A B, then B A) so that a drift in the machine's
  load does not always favour one side. An untimed warm-up pair comes first (it pays imports,
  caches, database creation).
- **Per-pair ratio.** Each pair gives one ratio (its formula is the measure's metric). The
  figure is the **median of the per-pair ratios**, with their min–max in brackets: never the
  median of one side divided by the median of the other, which would mix pairs.
- **Interval.** `CI` is a 95 % confidence interval of that median (percentile bootstrap,
  `scipy.stats.bootstrap`, seeded). With one pair there is none. With few pairs it is about
  as wide as min–max: more pairs narrow it.
- **Verdict.** *met*: the whole interval meets the target; *missed*: none of it does;
  *undecided*: the interval straddles the target, or there is no interval. A verdict on an
  absolute check (a time, steps lost) comes from its own interval, or from its worst value
  where the check is a bound every run must keep. A missed target is reported, never hidden.
  A row's verdict in the summary combines its ratio's and its checks': *missed* if any is,
  else *undecided* if any is, else *met*; its details give each one's own.
- **CPU beside wall.** For each side: the median wall time and CPU time (user + system of the
  benchmark process and every child it waited for: the whole process tree) of one run. The CPU
  ratio is per pair as well (Stoker's CPU / the baseline's). On a shared machine the CPU time
  is the steadier figure: wall time also counts waiting for a core.
- **Commit.** Results are from the commit in the machine table; a checkout with uncommitted
  changes is marked (and a full run refuses to publish one).
"""


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def spread(s: dict | None) -> str:
    """``median [min–max]`` of a summary, or ``-``."""
    if not s:
        return "-"
    return f"{fmt(s['median'])} [{fmt(s['min'])}–{fmt(s['max'])}]"


def interval(s: dict | None) -> str:
    ci = (s or {}).get("ci")
    return f"{fmt(ci[0])}–{fmt(ci[1])}" if ci else "-"


def side(s: dict | None) -> str:
    """One side's figure, then its wall and CPU seconds per run (medians)."""
    if not s:
        return "-"
    text = f"{spread(s)} {s['unit']} (n={s['n']})"
    if s.get("wall_s") and s.get("cpu_s"):
        text += f"; wall {fmt(s['wall_s']['median'])} s, CPU {fmt(s['cpu_s']['median'])} s"
    return text


def verdict(result: dict) -> str:
    status = result.get("status")
    if status != "ok":
        return f"{status}: {result['reason']}" if result.get("reason") else str(status)
    text = {"met": "met", "missed": "**missed**", "undecided": "undecided",
            None: "no verdict"}[result.get("verdict")]
    return text + (" (uncommitted changes)" if (result.get("checkout") or {}).get("dirty")
                   else "")


def summary_table(rows: list[tuple[str, str, str, dict]]) -> list[str]:
    out = ["| # | measure | baseline | Stoker | per-pair ratio [min–max] | 95 % CI | "
           "CPU ratio [min–max] | target | verdict |",
           "|---|---|---|---|---|---|---|---|---|"]
    for n, (_, title, target, result) in enumerate(rows, 1):
        pairs = result.get("pairs")
        ratio = spread(pairs) if pairs else fmt(result.get("ratio"))
        out.append(f"| {n} | {title} | {side(result.get('baseline'))} | "
                   f"{side(result.get('candidate'))} | {ratio} | {interval(pairs)} | "
                   f"{spread(result.get('cpu_ratio'))} | {target} | {verdict(result)} |")
    return out


def details(n: int, stem: str, title: str, result: dict) -> list[str]:
    out = [f"### {n}. {title} (`{stem}.py`)", ""]
    pairs = result.get("pairs")
    if result.get("metric") and result.get("status") == "ok" and pairs:
        # The ratio's own verdict, from its own interval; the row's combines it with the checks.
        own = pairs.get("verdict") or "informative"
        out.append(f"Per-pair ratio: {result['metric']} = **{spread(pairs)}**, 95 % CI "
                   f"{interval(pairs)}, {pairs['n']} pair(s) (target {result.get('target')}: "
                   f"{own}). Ran in {fmt(result.get('wall_s'))} s at "
                   f"{fmt((result.get('checkout') or {}).get('commit'))}.")
        if result.get("checks"):
            out += ["", "Verdict of the row (the ratio's and every check's): "
                    f"{verdict(result)}."]
    else:
        out.append(f"{verdict(result)}.")
    out.append("")
    for c in result.get("checks") or []:
        how = "worst run" if c.get("statistic") == "max" else \
            f"median [min–max] {spread(c)}, CI {interval(c)}"
        out.append(f"- {c['name']}: {fmt(c['value'])} {c['unit']} ({how}; target "
                   f"{c['target']}: {c['verdict']})")
    out += [f"- {note}" for note in result.get("notes") or []]
    out.append("")
    return out


def gpu_section(gpu: dict) -> list[str]:
    """The GPU check's steps (``benchmarks/gpu_check.sh``'s results file) as a table."""
    from benchmarks.gpu_check import headline

    out = ["## GPU check", "",
           f"From `benchmarks/gpu_check.sh` on a GPU machine, {gpu.get('written', '?')} (a "
           "separate run: its own machine, sizes and commit; each benchmark step's JSON "
           "result is in the results file).", "",
           "| step | status | seconds | figure |", "|---|---|---|---|"]
    for name, step in (gpu.get("steps") or {}).items():
        out.append(f"| {name} | {step.get('status')} | {fmt(step.get('seconds'))} | "
                   f"{headline(name, step.get('result'))} |")
    return [*out, ""]


def render(rows: list[tuple[str, str, str, dict]], info: dict[str, str], quick: bool,
           wall_s: float, gpu: dict | None = None) -> str:
    """RESULTS.md: how to read it, the machine, the summary table, each measure, then the GPU
    check when its results file is given.

    Args:
        rows: (script stem, title, target as stated, its JSON result) per measure.
        info: the machine description (name -> text).
        quick: a smoke run (marked as such).
        wall_s: seconds the whole run took (a merged table: its measures' own runs).
        gpu: the results file of ``benchmarks/gpu_check.sh`` (parsed), or None.
    """
    out = ["# Stoker benchmark results", "",
           f"Written by `python benchmarks/run_all.py{' --quick' if quick else ''}` on "
           f"{info['date']} in {wall_s / 60:.1f} minutes. "
           + ("**Quick smoke run: tiny sizes, one pair each, no warm-up; the figures mean "
              "little and no interval exists.**" if quick else "Full size."),
           "", HOW_TO_READ, "## Machine", "", "| | |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in info.items()]
    out += ["", "## Summary", "", *summary_table(rows), "", "## Details", ""]
    for n, (stem, title, _, result) in enumerate(rows, 1):
        out += details(n, stem, title, result)
    if gpu:
        out += gpu_section(gpu)
    return "\n".join(out)

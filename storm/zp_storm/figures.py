"""The storm's figures: ``storm.png`` for one run, ``sweep.png`` for a sweep over offered load.

Every setup keeps one style in every figure (:func:`setup_style`): a colour of the Okabe-Ito palette
(safe for the common colour-vision deficiencies), a dash pattern and a marker, so that no line depends on
colour alone. Figures read only the report dictionaries (``report.json`` / ``sweep.json``), so they can be
redrawn from a saved run. matplotlib is imported lazily with the Agg backend (the ``bench`` extra).
"""

from __future__ import annotations

import math
import textwrap
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["OKABE_ITO", "SetupStyle", "limit_figure", "setup_style", "storm_figure", "sweep_figure",
           "write_limit_png", "write_storm_png", "write_sweep_png"]

#: The Okabe-Ito palette (Okabe & Ito 2008, "Color Universal Design"), by name.
OKABE_ITO: dict[str, str] = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}


@dataclass(frozen=True)
class SetupStyle:
    """How one setup is drawn in every figure."""

    color: str
    linestyle: str | tuple[float, tuple[float, ...]]
    marker: str
    hatch: str = ""


_STYLES: dict[str, SetupStyle] = {
    "no-admission": SetupStyle(OKABE_ITO["black"], "solid", "o"),
    "naive": SetupStyle(OKABE_ITO["vermillion"], (0, (6, 2)), "X"),
    "rate-limited": SetupStyle(OKABE_ITO["orange"], (0, (1, 1.5)), "v"),
    "zp-strict": SetupStyle(OKABE_ITO["sky_blue"], (0, (4, 1.5, 1, 1.5)), "s"),
    "zp-elastic": SetupStyle(OKABE_ITO["blue"], "solid", "D"),
    "zp-oracle": SetupStyle(OKABE_ITO["bluish_green"], (0, (3, 1)), "^"),
    "zp-adaptive": SetupStyle(OKABE_ITO["blue"], (0, (5, 1, 1, 1)), "p"),
    "zp-elastic-ureserve": SetupStyle(OKABE_ITO["sky_blue"], (0, (2, 2)), "d"),
    "zp-pinned": SetupStyle(OKABE_ITO["bluish_green"], "solid", "2"),
    "zp-pinned-timer": SetupStyle(OKABE_ITO["orange"], (0, (4, 2)), "3"),
    "clairvoyant": SetupStyle(OKABE_ITO["reddish_purple"], (0, (6, 1.5, 1, 1.5, 1, 1.5)), "P"),
    "zp-redis": SetupStyle(OKABE_ITO["sky_blue"], (0, (1, 1)), "h", "//"),
    "zp-redis-elastic": SetupStyle(OKABE_ITO["blue"], (0, (1, 1)), "*", "//"),
    # issue 30 (goodput under overload): letter markers, every other marker is taken
    "zp-slo": SetupStyle(OKABE_ITO["blue"], (0, (8, 1, 2, 1)), "$S$"),
    "zp-oracle-h1": SetupStyle(OKABE_ITO["bluish_green"], (0, (1, 1, 4, 1)), "$H$"),
    "zp-oracle-slo": SetupStyle(OKABE_ITO["bluish_green"], (0, (8, 1, 2, 1)), "$O$"),
    "vllm-priority": SetupStyle(OKABE_ITO["reddish_purple"], (0, (3, 1, 1, 1)), "$P$"),
    "vllm-queue-cap": SetupStyle(OKABE_ITO["orange"], (0, (5, 2, 1, 2)), "$Q$"),
    # the fleet setups (--replicas N)
    "rr": SetupStyle(OKABE_ITO["vermillion"], (0, (2, 1)), "<"),
    "rr-zp": SetupStyle(OKABE_ITO["sky_blue"], (0, (6, 1, 1, 1)), ">"),
    "epp": SetupStyle(OKABE_ITO["reddish_purple"], "solid", "8"),
    "zp-fleet": SetupStyle(OKABE_ITO["blue"], (0, (8, 2)), "H"),
    "zp-fleet-strict": SetupStyle(OKABE_ITO["sky_blue"], (0, (3, 3)), "x"),
    "zp-fleet-redis": SetupStyle(OKABE_ITO["blue"], (0, (2, 1, 1, 1)), "+", "\\\\"),
    "zp-fleet-redis-strict": SetupStyle(OKABE_ITO["sky_blue"], (0, (2, 1, 1, 1)), "1", "\\\\"),
    # the P/D setups (--pd P:D)
    "pd-proxy": SetupStyle(OKABE_ITO["vermillion"], (0, (1, 2)), "4"),
    "pd-noadmission": SetupStyle(OKABE_ITO["black"], (0, (4, 1)), "|"),
    "zp-fleet-chunk512": SetupStyle(OKABE_ITO["bluish_green"], (0, (8, 2)), "_"),
    "zp-pd": SetupStyle(OKABE_ITO["blue"], (0, (3, 1, 1, 1, 1, 1)), "."),
}
_FALLBACK_COLORS = ("#999999", "#882255", "#44AA99", "#117733", "#332288", "#AA4499")
_FALLBACK_MARKERS = ("p", "d", "<", ">", "8", "H")


def setup_style(name: str) -> SetupStyle:
    """The fixed style of setup ``name``: the same in every figure and every run.

    The benchmark's setups have assigned styles; any other name gets one chosen by a stable hash of the
    name (CRC-32, not Python's per-process salted ``hash``), so it too never changes between runs.
    """
    if name in _STYLES:
        return _STYLES[name]
    h = zlib.crc32(name.encode())
    return SetupStyle(_FALLBACK_COLORS[h % len(_FALLBACK_COLORS)], (0, (2, 1, 2, 3)),
                      _FALLBACK_MARKERS[(h // 7) % len(_FALLBACK_MARKERS)])


def _new_figure(figsize: tuple[float, float]) -> Any:
    """A matplotlib ``Figure`` on an Agg canvas, outside pyplot (no global figure state, no GUI backend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _setup_label(m: dict[str, Any]) -> str:
    return str(m["setup"]) + ("" if m.get("valid", True) else " (SATURATED)")


def _bars(ax: Any, setups: list[dict[str, Any]], values: list[float | None], labels: list[str],
          title: str, xlabel: str, refs: list[tuple[str, float | None]]) -> None:
    """Horizontal bars, one per setup (first on top), each labelled with ``labels``; a vertical line in
    the reference setup's colour and dash pattern at each of ``refs`` (setup name, value)."""
    ys = list(range(len(setups)))
    vals = [v or 0.0 for v in values]
    for y, m, v in zip(ys, setups, vals, strict=True):
        st = setup_style(m["setup"])
        ax.barh(y, v, color=st.color, edgecolor="black", linewidth=0.6, hatch=st.hatch or None,
                alpha=0.9 if m.get("valid", True) else 0.35)
    top = max(vals + [r or 0.0 for _, r in refs]) or 1.0
    for y, v, lab in zip(ys, vals, labels, strict=True):
        ax.text(v + top * 0.01, y, lab, va="center", ha="left", fontsize=8.5, zorder=4,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
    for name, r in refs:
        if r is not None:
            st = setup_style(name)
            ax.axvline(r, color=st.color, lw=1.1, ls=(0, (2, 1.5)), zorder=3)
    ax.set_yticks(ys, [_setup_label(m) for m in setups])
    ax.set_ylim(len(setups) - 0.5, -0.5)  # first setup on top, as in the table
    ax.set_xlim(0, top * 1.42)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)
    for y, m in zip(ys, setups, strict=True):
        ax.get_yticklabels()[y].set_color(setup_style(m["setup"]).color if m["setup"] != "no-admission"
                                          else "black")


#: The outcome panel's segments: (metrics key, label, hatch); colours are greys so that the setups' own
#: colours stay theirs, the hatches tell the segments apart without colour.
_OUTCOMES = (("in_slo", "in SLO", ""), ("late", "completed late", "///"), ("failed", "failed", "xx"))
_OUTCOME_GREYS = ("0.35", "0.7", "0.95")


def _outcome_bars(ax: Any, setups: list[dict[str, Any]]) -> None:
    """One stacked bar per setup: its requests within the SLO, completed late and failed (counts), each
    labelled with the three counts, the gateway's 504s and the amplification."""
    ys = list(range(len(setups)))
    total = max([sum(int(m.get(k) or 0) for k, _, _ in _OUTCOMES) for m in setups] + [1])
    for (key, label, hatch), grey in zip(_OUTCOMES, _OUTCOME_GREYS, strict=True):
        lefts = [sum(int(m.get(k) or 0) for k, _, _ in _OUTCOMES[:[o[0] for o in _OUTCOMES].index(key)])
                 for m in setups]
        widths = [int(m.get(key) or 0) for m in setups]
        ax.barh(ys, widths, left=lefts, color=grey, edgecolor="black", linewidth=0.6, hatch=hatch or None,
                label=label)
    for y, m in zip(ys, setups, strict=True):
        n = sum(int(m.get(k) or 0) for k, _, _ in _OUTCOMES)
        amp = m.get("amplification")
        rej = f", 503s {m['rejected_503']}" if m.get("rejected_503") else ""
        text = (f"{m.get('in_slo', '?')} / {m.get('late', '?')} / {m.get('failed', '?')}; "
                f"504s {m.get('gateway_504', 0)}{rej}, ampl {'-' if amp is None else f'{amp:.2f}'}")
        ax.text(n + total * 0.01, y, text, va="center", ha="left", fontsize=8.5, zorder=4,
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
    ax.set_yticks(ys, [_setup_label(m) for m in setups])
    for y, m in zip(ys, setups, strict=True):
        ax.get_yticklabels()[y].set_color(setup_style(m["setup"]).color if m["setup"] != "no-admission"
                                          else "black")
    ax.set_ylim(len(setups) - 0.5, -0.5)
    ax.set_xlim(0, total * 1.75)
    ax.set_title("requests: in SLO / completed late / failed; gateway 504s, amplification", fontsize=10,
                 loc="left")
    # the key in the axis label: a legend box would cover the last bar's numbers
    ax.set_xlabel("logical requests, each scored against its own class's SLO\n"
                  "dark = in SLO, /// = completed late, xx = failed (or never sent)", fontsize=8.5)
    ax.grid(axis="x", alpha=0.3)


def _preemption_lanes(ax: Any, report: dict[str, Any], setups: list[dict[str, Any]]) -> None:
    """One lane per setup: its cumulative preemptions as a step line, all lanes on one scale."""
    tls = report.get("timelines", {})
    peak = max([m.get("preemptions") or 0 for m in setups]
               + [max((p[2] for p in tls.get(m["setup"], [])), default=0) for m in setups]) or 1
    t_end = max([tl[-1][0] for tl in tls.values() if tl] + [m.get("makespan") or 0 for m in setups] + [1e-9])
    h = 0.8
    for i, m in enumerate(setups):
        st = setup_style(m["setup"])
        base = float(len(setups) - 1 - i)  # first setup on top
        tl = tls.get(m["setup"], [])
        ts = [p[0] for p in tl] or [0.0]
        cum = [p[2] for p in tl] or [0]
        ts, cum = [0.0, *ts, t_end], [0, *cum, cum[-1]]
        ys = [base + h * c / peak for c in cum]
        ax.axhline(base, color="0.85", lw=0.6, zorder=0)
        ax.fill_between(ts, base, ys, step="post", color=st.color, alpha=0.25, lw=0)
        ax.step(ts, ys, where="post", color=st.color, lw=1.6, ls=st.linestyle)
        n = m.get("preemptions") or 0
        kv = m.get("kv_usage_max")
        label = f"{n} preempted" + (f", KV max {kv:.2f}" if kv is not None else "")
        ax.text(t_end * 1.01, base + 0.05, label, fontsize=8, va="bottom", ha="left", color="black",
                fontweight="bold" if n else "normal")
    ax.set_yticks([len(setups) - 1 - i for i in range(len(setups))], [_setup_label(m) for m in setups])
    for i, m in enumerate(setups):
        ax.get_yticklabels()[i].set_color(setup_style(m["setup"]).color)
    ax.set_ylim(-0.3, len(setups) - 1 + h + 0.25)
    ax.set_xlim(0, t_end * 1.32)
    ax.set_xlabel("virtual seconds since the run's start", fontsize=8.5)
    ax.set_title(f"server preemptions over time, cumulative (one lane per setup; lane height = {peak})",
                 fontsize=10, loc="left")
    ax.grid(axis="x", alpha=0.3)


def _ttft_ecdf(ax: Any, report: dict[str, Any], setups: list[dict[str, Any]]) -> None:
    ttfts = report.get("ttfts", {})
    floor = 1e-3
    lo, hi = math.inf, 0.0
    for m in setups:
        xs = sorted(max(floor, x) for x in ttfts.get(m["setup"], []))
        if not xs:
            continue
        st = setup_style(m["setup"])
        n = len(xs)
        lo, hi = min(lo, xs[0]), max(hi, xs[-1])
        ax.step([xs[0], *xs], [0.0, *[(k + 1) / n for k in range(n)]], where="post", color=st.color,
                ls=st.linestyle, lw=1.6, label=f"{m['setup']} (n={n})")
    slo = report.get("slo", {}).get("ttft_s")
    if slo:
        ax.axvline(slo, color="black", lw=0.9, ls=(0, (2, 2)), label=f"SLO: TTFT <= {slo:g} s")
        hi = max(hi, slo)
    ax.set_xscale("log")
    if math.isfinite(lo):
        ax.set_xlim(lo / 1.5, hi * 1.5)
    ax.set_ylim(0, 1.02)
    ax.set_title("TTFT as the app sees it (queue wait and retries included), successful requests",
                 fontsize=10, loc="left")
    ax.set_xlabel("TTFT, virtual seconds (log scale)", fontsize=8.5)
    ax.set_ylabel("share of requests with TTFT <= x", fontsize=8.5)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7.5, loc="lower right", framealpha=0.9)


_TITLE_PT, _BODY_PT, _NOTE_PT = 12.5, 9.5, 7.5


def _wrap(lines: list[str], width_in: float, pt: float, bold: bool = False) -> list[str]:
    """``lines`` wrapped to fit ``width_in`` inches at ``pt`` points (a conservative average glyph width)."""
    chars = max(40, int(width_in * 72 / (pt * (0.58 if bold else 0.54))))
    return [w for line in lines for w in (textwrap.wrap(line, chars, subsequent_indent="   ") or [""])]


def _header(verdict: list[str], fallback: str, width_in: float) -> tuple[list[str], list[str], float]:
    """The wrapped title and body lines, and the inches they take at the top of a figure."""
    title = _wrap(verdict[:1] or [fallback], width_in - 0.4, _TITLE_PT, bold=True)
    body = _wrap(verdict[1:], width_in - 0.4, _BODY_PT)
    height = 0.15 + len(title) * _TITLE_PT * 1.3 / 72 + 0.08 + len(body) * _BODY_PT * 1.3 / 72 + 0.1
    return title, body, height


def _draw_header(fig: Any, title: list[str], body: list[str], note: str, width_in: float) -> None:
    h = fig.get_figheight()
    fig.suptitle("\n".join(title), fontsize=_TITLE_PT, fontweight="bold", x=0.2 / width_in, y=1 - 0.12 / h,
                 ha="left", va="top")
    y = 1 - (0.15 + len(title) * _TITLE_PT * 1.3 / 72 + 0.08) / h
    if body:
        fig.text(0.2 / width_in, y, "\n".join(body), fontsize=_BODY_PT, va="top", ha="left")
    fig.text(0.2 / width_in, 0.08 / h, "\n".join(_wrap([note], width_in - 0.4, _NOTE_PT)), fontsize=_NOTE_PT,
             va="bottom", ha="left", color="0.25")


def storm_figure(report: dict[str, Any], verdict: list[str] | None = None) -> Any:
    """One storm run as a matplotlib ``Figure``: goodput per setup (bars), its requests in SLO / completed
    late / failed (stacked bars, with the gateway's 504s and the amplification),
    preemptions over time (one lane per setup), TTFT ECDFs (log axis); ``verdict`` (default
    ``report["verdict"]``) is the title: its first line the (bold) suptitle, the others below it."""
    setups = report["setups"]
    verdict = verdict if verdict is not None else list(report.get("verdict", []))
    by = {m["setup"]: m for m in setups}
    base = by.get("no-admission")
    base_g = base.get("goodput_rps") if base else None
    w, slo = report["workload"], report.get("slo", {})

    width, plots_in, foot_in = 14.0, 9.0, 1.05
    title, body, head_in = _header(verdict, f"zp-client storm: {w['name']} (seed {w['seed']})", width)
    height = head_in + 0.35 + plots_in + foot_in
    fig = _new_figure((width, height))
    gs = fig.add_gridspec(2, 2, height_ratios=[1, 1.15], hspace=0.32, wspace=0.42, left=0.1, right=0.97,
                          top=1 - (head_in + 0.35) / height, bottom=foot_in / height)
    ax_g, ax_s = fig.add_subplot(gs[0, 0]), fig.add_subplot(gs[0, 1])
    ax_p, ax_t = fig.add_subplot(gs[1, 0]), fig.add_subplot(gs[1, 1])

    def refs(key: str) -> list[tuple[str, float | None]]:
        return [(n, by[n].get(key)) for n in ("no-admission", "naive") if n in by]

    g_labels = []
    for m in setups:
        g = m.get("goodput_rps")
        lab = "-" if g is None else f"{g:.3f}"
        if g is not None and base_g and m["setup"] != "no-admission":
            lab += f" ({g / base_g:.2f}x)"
        g_labels.append(lab)
    _bars(ax_g, setups, [m.get("goodput_rps") for m in setups], g_labels,
          "goodput: requests that met the SLO per virtual second",
          "good requests / virtual s (in brackets: x no-admission's); vertical lines: no-admission, naive",
          refs("goodput_rps"))
    _outcome_bars(ax_s, setups)
    _preemption_lanes(ax_p, report, setups)
    _ttft_ecdf(ax_t, report, setups)

    note = ("goodput = logical requests that succeeded within the SLO "
            f"(TTFT <= {slo.get('ttft_s', '?')} s and time per output token <= "
            f"{(slo.get('tpot_s') or 0) * 1000:.0f} ms; a non-streamed call within TTFT + output x TPOT) "
            "per virtual second of the run's makespan. All times are virtual seconds of the simulator's "
            "clock; preemptions are the simulated vLLM server's own count.")
    _draw_header(fig, title, body, note, width)
    return fig


def _dodge(loads: list[float], i: int, n: int, log: bool) -> list[float]:
    """Horizontal offsets so that setups with equal values stay visible side by side."""
    k = (i - (n - 1) / 2) * 0.02
    return [x * (1 + k) if log else x + k * (max(loads) - min(loads) or 1.0) for x in loads]


def write_storm_png(report: dict[str, Any], path: Path, verdict: list[str] | None = None) -> None:
    """Write :func:`storm_figure` to ``path`` as a PNG."""
    storm_figure(report, verdict).savefig(path, dpi=100)


def sweep_figure(sweep: dict[str, Any]) -> Any:
    """A sweep as a matplotlib ``Figure``: goodput, share within SLO, amplification and preemptions
    against offered load, one line per setup (styles as in ``storm.png``; points dodged sideways so
    equal values stay visible), log-x when the loads span more than 4x; the verdict is the title."""
    from matplotlib.ticker import FuncFormatter

    loads: list[float] = list(sweep["loads"])
    names: list[str] = list(sweep["setups"])
    data: dict[str, dict[str, list[Any]]] = sweep["metrics"]
    log = bool(loads) and min(loads) > 0 and max(loads) / min(loads) > 4
    panels = [("goodput_rps", "goodput (requests within the SLO per virtual s)"),
              ("slo_attainment", "share of requests within the SLO"),
              ("amplification", "amplification (HTTP requests at the server / logical request)"),
              ("preemptions", "server preemptions")]
    w = sweep.get("workload", {})
    width, plots_in, legend_in, foot_in = 13.0, 8.2, 0.45, 1.0
    title, body, head_in = _header(list(sweep.get("verdict", [])),
                                   f"zp-client storm sweep: {w.get('name', '?')}", width)
    height = head_in + legend_in + 0.3 + plots_in + foot_in
    fig = _new_figure((width, height))
    axes = fig.subplots(2, 2)
    fig.subplots_adjust(left=0.07, right=0.98, top=1 - (head_in + legend_in + 0.3) / height,
                        bottom=foot_in / height, hspace=0.38, wspace=0.2)
    handles = []
    for ax, (key, ptitle) in zip(axes.flat, panels, strict=True):
        top = 0.0
        for i, name in enumerate(names):
            st = setup_style(name)
            ys = data.get(name, {}).get(key, [])
            xs = _dodge(loads, i, len(names), log)
            pts = [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None]
            if not pts:
                continue
            top = max(top, *(p[1] for p in pts))
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], color=st.color, ls=st.linestyle,
                              marker=st.marker, ms=7, lw=1.6, label=name, markeredgecolor="black",
                              markeredgewidth=0.5, clip_on=False)
            if ax is axes.flat[0]:
                handles.append(line)
        if log:
            ax.set_xscale("log", base=2)
        ax.set_xticks(loads, [f"{x:g}x" for x in loads])
        ax.minorticks_off()
        ax.set_title(ptitle, fontsize=10, loc="left")
        ax.set_xlabel("offered load (x the workload's arrival rate)", fontsize=8.5)
        ax.grid(alpha=0.3)
        if key == "slo_attainment":
            ax.set_ylim(-0.03, 1.05)
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0%}"))
        elif key == "amplification":
            ax.set_ylim(0.98, max(1.2, top * 1.05))
        else:
            ax.set_ylim(-0.04 * (top or 1.0), (top or 1.0) * 1.08)
    if handles:
        fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 9), fontsize=9, frameon=False,
                   bbox_to_anchor=(0.5, 1 - (head_in + 0.02) / height), handlelength=3.2)
    note = ("Points of equal value are dodged sideways so that none hides another; ticks mark the true "
            "loads. Goodput = logical requests that succeeded within the SLO per virtual second of makespan. "
            "Times are virtual seconds of the simulator's clock.")
    _draw_header(fig, title, body, note, width)
    return fig


def write_sweep_png(sweep: dict[str, Any], path: Path) -> None:
    """Write :func:`sweep_figure` to ``path`` as a PNG."""
    sweep_figure(sweep).savefig(path, dpi=100)


def limit_figure(report: dict[str, Any]) -> Any:
    """The budget limit over the run, for every setup with a ``limit_timeline`` (the adaptive limit): one
    step line per setup (styles as in ``storm.png``), each change a marker; the usable pool
    (num_gpu_blocks - 1) as a dashed line; the bypass window, if the run had one, shaded. Reads only the
    report dictionary (``report["limit_timelines"]``)."""
    tls: dict[str, list[list[float]]] = report.get("limit_timelines") or {}
    by = {m["setup"]: m for m in report.get("setups", [])}
    w = report.get("workload", {})
    fig = _new_figure((11.0, 5.2))
    ax = fig.add_subplot(1, 1, 1)
    fig.subplots_adjust(left=0.09, right=0.97, top=0.86, bottom=0.13)
    t_end = max([tl[-1][0] for tl in tls.values() if tl]
                + [by[n].get("makespan") or 0 for n in tls if n in by] + [1e-9])
    lo, hi = math.inf, 0.0
    for name, tl in tls.items():
        if not tl:
            continue
        st = setup_style(name)
        ts = [p[0] for p in tl] + [max(t_end, tl[-1][0])]
        ys = [p[1] for p in tl] + [tl[-1][1]]
        lo, hi = min(lo, *ys), max(hi, *ys)
        ax.step(ts, ys, where="post", color=st.color, ls=st.linestyle, lw=1.8,
                label=f"{name}: {len(tl) - 1} changes, {int(min(ys))}-{int(max(ys))} blocks")
        ax.plot(ts[1:-1], ys[1:-1], ls="none", marker=st.marker, color=st.color, ms=5,
                markeredgecolor="black", markeredgewidth=0.4)
    pool = report.get("server", {}).get("num_gpu_blocks")
    if pool:
        ax.axhline(pool - 1, color="black", lw=0.9, ls=(0, (2, 2)), label=f"usable pool: {pool - 1} blocks")
        hi = max(hi, pool - 1)
    window = (report.get("bypass") or {}).get("window")
    if window is not None:
        end = window[1] if window[1] is not None else t_end
        ax.axvspan(window[0], min(end, t_end), color="0.85", alpha=0.6, lw=0, label="bypass window")
    elif report.get("bypass"):
        ax.text(0.99, 0.98, f"bypass {report['bypass']['fraction']:.0%} of the requests, the whole run",
                transform=ax.transAxes, fontsize=8, ha="right", va="top",
                bbox={"facecolor": "white", "edgecolor": "none", "pad": 0.6, "alpha": 0.85})
    if math.isfinite(lo):
        pad = max(1.0, 0.05 * (hi - lo))
        ax.set_ylim(max(0.0, lo - pad), hi + pad)
    ax.set_xlim(0, t_end * 1.02)
    ax.set_xlabel("virtual seconds since the run's start", fontsize=9)
    ax.set_ylabel("budget limit, KV blocks", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best", framealpha=0.9)
    fig.suptitle(f"zp budget limit over time: {w.get('name', '?')} (seed {w.get('seed', '?')})", fontsize=12,
                 fontweight="bold", x=0.09, ha="left")
    return fig


def write_limit_png(report: dict[str, Any], path: Path) -> None:
    """Write :func:`limit_figure` to ``path`` as a PNG."""
    limit_figure(report).savefig(path, dpi=100)

"""``tieredkv reproduce``'s report explains itself: what each system is (``vllm`` recomputes
the whole history, ``ideal`` is an upper bound), why a throughput does not grow with the SSD's
bandwidth (with a link to the simulator's explanation), and each system has one color in
every figure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tieredkv.sim.plots import SYSTEM_COLORS, figures
from tieredkv.sim.render import render_markdown
from tieredkv.sim.report import ReproduceOptions, reproduce
from tieredkv.sim.workloads import WorkloadSpec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> object:
    options = ReproduceOptions(
        workload=WorkloadSpec(minutes=2),
        systems=("vllm", "flashgen", "bidaw", "ideal"),
        rates=(5.0, 10.0),
        workers=1,
    )
    return reproduce(options)


def test_the_report_says_what_each_system_is(report: object) -> None:
    text = render_markdown(report, "tieredkv reproduce")  # type: ignore[arg-type]
    assert (
        "| vllm | vLLM without a KV cache between turns: each turn recomputes (prefills) the "
        "conversation's whole history |"
    ) in text
    assert "| ideal | an upper bound, not a system: every history stays in host memory" in text
    assert "| bidaw | Bidaw (FAST'26)" in text
    page = (ROOT / "docs" / "explanation" / "simulator.md").as_uri()
    assert f"[the simulator]({page}#systems) (`docs/explanation/simulator.md`)" in text


def test_a_flat_ssd_bandwidth_line_is_explained_with_a_link(report: object) -> None:
    r = report
    flat = [s for s, per in r.ssd_bandwidth.items() if len(set(per.values())) == 1]  # type: ignore[attr-defined]
    assert "bidaw" in flat  # 10 users/min is met at either bandwidth
    text = render_markdown(r, "tieredkv reproduce")  # type: ignore[arg-type]
    section = text[text.index("## 6. SSD bandwidth") : text.index("## 7.")]
    assert ": the same throughput at every bandwidth. A flat line means the SSD" in section
    page = (ROOT / "docs" / "explanation" / "simulator.md").as_uri()
    assert f"[the simulator]({page}#calibration-against-the-papers-figures)" in section
    # the anchor exists on the page
    assert (
        "\n## Calibration against the paper's figures\n"
        in (ROOT / "docs" / "explanation" / "simulator.md").read_text()
    )


def test_each_system_has_one_color_in_every_figure(report: object) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    seen: dict[str, set[str]] = {}
    for _, fig in figures(report):  # type: ignore[arg-type]
        for ax in fig.axes:
            for line in ax.get_lines():
                label = str(line.get_label())
                if label in SYSTEM_COLORS:
                    seen.setdefault(label, set()).add(str(line.get_color()))
        plt.close(fig)
    assert seen["bidaw"] == {"tab:red"}  # the latency, queueing and both sensitivity plots
    assert seen["flashgen"] == {"tab:green"}
    assert all(len(colors) == 1 for colors in seen.values()), seen


def test_the_readme_links_the_simulators_explanation() -> None:
    assert "(docs/explanation/simulator.md)" in (ROOT / "README.md").read_text()

"""Every speed figure the README and the guides print from the records in docs/results, read again from its record.

Records are the truth: when a page and its record disagree, the page changes. A page's figure is the first
``N.NNx`` (or range ``N.NN-N.NNx``) of a table cell or, where ``near`` says, the one in its place in the cell or
the page (``near`` is the text around it, ``{}`` the figure). The record's is a row's speedup printed the same
way: two decimals; several rows or a row's per-round speedups print as their lowest and highest.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Dict, List, NamedTuple, Optional, Tuple, Union

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results"
FIGURE = r"(\d+\.\d\d(?:x?-\d+\.\d\d)?)(?!\d)"


class Where(NamedTuple):
    """A printed figure: a table cell (``row`` its first cell, ``column`` its header) or, with ``row`` None, prose."""
    doc: str
    row: Optional[str]
    column: Optional[str] = None
    near: Optional[str] = None


class Read(NamedTuple):
    """A recorded figure: ``field`` of the one row of ``part`` (dotted keys into the record) whose fields equal
    ``where``; a part that maps methods to rows reads as rows with those methods."""
    record: str
    where: Dict[str, str]
    part: str = "rows"
    field: str = "speedup"


def cpu(record: str, method: str, part: str = "rows", field: str = "speedup") -> Read:
    """A row of a CPU record, by its method."""
    return Read(record, {"method": method}, part, field)


def gpu(case: str, execution: str, method: str, part: str = "rows", record: str = "gpu_h200_speed.json") -> Read:
    """A whole call of gpu_speed.py's record: its case, eager or in a CUDA graph, and method."""
    return Read(record, {"row": "call", "case": case, "execution": execution, "method": method}, part)


def gpu_columns(case: str) -> List[Tuple[str, None, Read]]:
    """The performance table's CUDA-graph cells of one case: the default, its oracle, ``prefer="speed"``."""
    return [("GPU, CUDA graph", None, gpu(case, "graph", "default")),
            ("its oracle, graph", None, gpu(case, "graph", "oracle of default")),
            ('`prefer="speed"`, graph', None, gpu(case, "graph", 'prefer="speed"'))]


def eager_runs(case: str, *parts: str) -> Tuple[Read, ...]:
    """The default's eager call in each run of gpu_h200_speed.json that timed it: printed as their range."""
    return tuple(gpu(case, "eager", "default", part) for part in ("rows", *parts))


SD15_512, SD15_1024, SDXL, FLUX = ("SD 1.5, 512 px, batch 2", "SD 1.5, 1024 px, batch 1", "SDXL, 1024 px, batch 1",
                                   "Flux width, 1024 px")
WAN_480, WAN_720 = "Wan 2.1 1.3B width, 480x832, 81 frames", "Wan 2.1 1.3B width, 720x1280, 81 frames"
HUNYUAN = "HunyuanVideo width, 720x1280, 129 frames"
AGAIN, EARLIER = "sd15_eager_again.rows", "earlier_run.rows"
SD15_512_CPU, SD15_1024_CPU = "defaults_speed_sd15_512.json", "defaults_speed_sd15_1024.json"
SDXL_CPU, FLUX_CPU = "cpu_sdxl_1024_levels.json", "cpu_flux_1024.json"
WAN_CPU, WAN_720_CPU = "cpu_wan_block.json", "cpu_wan_block_720p.json"
SDXL_TOMESD = cpu(SDXL_CPU, "tomesd", "tomesd_max_downsample_2.rows")
PREFER_SPEED = '`prefer="speed"` {}x'

README = "README.md"
PERFORMANCE = "docs/performance.md"
VIDEO = "docs/video.md"
FIDELITY = "docs/fidelity.md"

FIGURES: List[Tuple[Where, Union[Read, Tuple[Read, ...]]]] = [
    # README's Speed table: the default, CPU and GPU (one call in a CUDA graph)
    *[(Where(README, row, column), read) for row, column, read in (
        ("SD 1.5 UNet, 512 px, batch 2", "CPU", cpu(SD15_512_CPU, "ours:auto")),
        ("SD 1.5 UNet, 512 px, batch 2", "GPU", gpu(SD15_512, "graph", "default")),
        ("SD 1.5 UNet, 1024 px", "CPU", cpu(SD15_1024_CPU, "ours:auto")),
        ("SD 1.5 UNet, 1024 px", "GPU", gpu(SD15_1024, "graph", "default")),
        ("SDXL UNet, 1024 px", "CPU", cpu(SDXL_CPU, "default")),
        ("SDXL UNet, 1024 px", "GPU", gpu(SDXL, "graph", "default")),
        ("Flux width, 1024 px (2 + 4 blocks)", "CPU", cpu(FLUX_CPU, "ours")),
        ("Flux width, 1024 px (2 + 4 blocks)", "GPU", gpu(FLUX, "graph", "default")),
        ("Wan 2.1 1.3B width, 480p, 81 frames (CPU: one block)", "CPU", cpu(WAN_CPU, "default")),
        ("Wan 2.1 1.3B width, 480p, 81 frames (CPU: one block)", "GPU", gpu(WAN_480, "graph", "default")),
    )],
    # docs/performance.md: the default against its bounds
    *[(Where(PERFORMANCE, row, column, near), read) for row, case, cells in (
        ("SD 1.5, 512 px", SD15_512, [
            ("CPU", None, cpu(SD15_512_CPU, "ours:auto")),
            ("GPU, eager", None, eager_runs(SD15_512, AGAIN, EARLIER)),
            ("tomesd 0.5, GPU eager", None, gpu(SD15_512, "eager", "tomesd 0.5"))]),
        ("SD 1.5, 1024 px", SD15_1024, [
            ("CPU", None, cpu(SD15_1024_CPU, "ours:auto")),
            ("GPU, eager", None, eager_runs(SD15_1024, AGAIN, EARLIER)),
            ("tomesd 0.5, GPU eager", None, gpu(SD15_1024, "eager", "tomesd 0.5"))]),
        ("SDXL, 1024 px", SDXL, [
            ("CPU", None, cpu(SDXL_CPU, "default")),
            ("CPU", "oracle {}x", cpu(SDXL_CPU, "oracle of default")),
            ("CPU", PREFER_SPEED, cpu(SDXL_CPU, 'prefer="speed"')),
            ("CPU", "tomesd {}x", SDXL_TOMESD),
            ("GPU, eager", None, eager_runs(SDXL, EARLIER)),
            ("tomesd 0.5, GPU eager", None, gpu(SDXL, "eager", "tomesd 0.5"))]),
        ("Flux width, 1024 px (2 + 4 of its 19 + 38 blocks)", FLUX, [
            ("CPU", None, cpu(FLUX_CPU, "ours")),
            ("CPU", "oracle {}x", cpu(FLUX_CPU, "oracle")),
            ("CPU", PREFER_SPEED, cpu(FLUX_CPU, "ours:speed")),
            ("GPU, eager", None, eager_runs(FLUX, EARLIER))]),
        *[(row, case, [
            ("CPU", None, cpu(record, "default")),
            ("CPU", "oracle {}x", cpu(record, "oracle of default")),
            ("CPU", PREFER_SPEED, cpu(record, 'prefer="speed"')),
            ("CPU", "whole clip {}x", cpu(record, "frame_window=None")),
            ("GPU, eager", None, gpu(case, "eager", "default"))]) for row, case, record in (
                ("Wan 2.1 1.3B width, 480p, 81 frames (32,760 tokens)", WAN_480, WAN_CPU),
                ("Wan 2.1 1.3B width, 720p, 81 frames (75,600 tokens)", WAN_720, WAN_720_CPU))],
        ("HunyuanVideo width, 720p, 129 frames (118,800 tokens)", HUNYUAN, [
            ("GPU, eager", None, gpu(HUNYUAN, "eager", "default"))]),
    ) for column, near, read in gpu_columns(case) + cells],
    # docs/performance.md's reading of the table
    (Where(PERFORMANCE, None, near="at `max_downsample=2` it ran {}x"), SDXL_TOMESD),
    (Where(PERFORMANCE, None, near="(calls {}x)"), SDXL_TOMESD._replace(field="speedups")),
    (Where(PERFORMANCE, None, near="in a busier run {}x"), cpu(WAN_CPU, "default", "busier_run")),
    (Where(PERFORMANCE, None, near="`frame_window=None`, runs {}x"), cpu(WAN_CPU, "frame_window=None")),
    # docs/video.md: Wan's frame window on the CPU
    *[(Where(VIDEO, row, column, near), read) for row, column, near, read in (
        ("default, `frame_window=1`", "480p, 32,760 tokens", None, cpu(WAN_CPU, "default")),
        ("default, `frame_window=1`", "480p, 32,760 tokens", "rounds {};", cpu(WAN_CPU, "default", field="speedups")),
        ("default, `frame_window=1`", "480p, 32,760 tokens", "{}x in a busier run",
         cpu(WAN_CPU, "default", "busier_run")),
        ("default, `frame_window=1`", "480p, 32,760 tokens", "its oracle ran {}x",
         cpu(WAN_CPU, "oracle of default", "busier_run")),
        ("default, `frame_window=1`", "720p, 75,600 tokens", None, cpu(WAN_720_CPU, "default")),
        *[(row, column, None, cpu(record, method))
          for row, method in (("`frame_window=None` (the whole clip, the default before)", "frame_window=None"),
                              ("oracle of the default (its tokens removed for free)", "oracle of default"))
          for column, record in (("480p, 32,760 tokens", WAN_CPU), ("720p, 75,600 tokens", WAN_720_CPU))],
    )],
    # docs/fidelity.md: the default beside ToMe for SD and tomesd, whole SD 1.5 UNet on the CPU
    *[(Where(FIDELITY, row, column), cpu(record, method))
      for row, method in (("default (4x4 cells at 1024 px, 2x2 at 512, one token drawn)", "ours:auto"),
                          ("the same cells, their mean (earlier default)", "ours:mean"),
                          ("`ratio=0.5` (ToMe for SD, size-aware)", "ours"),
                          ("tomesd 0.1.3, ratio 0.5", "peer"))
      for column, record in (("1024 px, batch 1 (spread)", SD15_1024_CPU), ("512 px, batch 2 (spread)", SD15_512_CPU))],
    # docs/how-it-works.md: Wan's eager GPU call before and after the aligned similarity product
    (Where("docs/how-it-works.md", None, near="Wan at 32,760 tokens ran {}x"),
     gpu(WAN_480, "eager", "default", record="gpu_h200_speed_before.json")),
    (Where("docs/how-it-works.md", None, near="{}x since the product of its match runs aligned"),
     gpu(WAN_480, "eager", "default")),
]

# Printed beside the figures above with no record in docs/results: ToMA's are its paper's.
UNRECORDED = [
    Where(PERFORMANCE, "SDXL, 1024 px", "ToMA, published"),
    Where(PERFORMANCE, "Flux width, 1024 px (2 + 4 of its 19 + 38 blocks)", "ToMA, published"),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _tables(doc: str) -> List[List[List[str]]]:
    """The doc's markdown tables, each as rows of cells (header first, separator dropped), labels unbolded."""
    tables: List[List[List[str]]] = []
    block: List[List[str]] = []
    for line in (ROOT / doc).read_text().splitlines() + [""]:
        if line.startswith("|"):
            block.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif block:
            tables.append([[row[0].strip("*"), *row[1:]] for i, row in enumerate(block) if i != 1])
            block = []
    return tables


def _cell(where: Where) -> str:
    found = [row[table[0].index(where.column)] for table in _tables(where.doc)
             if where.column in table[0] for row in table[1:] if row[0] == where.row]
    assert len(found) == 1, f"{where.doc}: {len(found)} tables have a row {where.row!r} and a column {where.column!r}"
    return found[0]


def printed(where: Where) -> str:
    """The figure the doc prints at ``where``, as ``N.NN`` or ``N.NN-N.NN``."""
    text = _cell(where) if where.row is not None else _flat((ROOT / where.doc).read_text())
    pattern = re.escape(_flat(where.near or "{}")).replace(re.escape("{}"), FIGURE)
    match = re.search(pattern, text)
    assert match, f"{where.doc}, row {where.row!r}, column {where.column!r}: no figure as {where.near or 'N.NNx'!r}"
    return match.group(1).replace("x", "")


def recorded(read: Read) -> List[float]:
    """The figures of the row ``read`` selects (a row ``same_as`` another reads as that one)."""
    node = json.loads((RESULTS / read.record).read_text())
    for key in read.part.split("."):
        node = node[key]
    rows = [{"method": method, **row} for method, row in node.items()] if isinstance(node, dict) else node
    chosen = [row for row in rows if all(row.get(key) == value for key, value in read.where.items())]
    assert len(chosen) == 1, f"{read.record} {read.part}: {len(chosen)} rows where {read.where}"
    if chosen[0].get(read.field) is None and "same_as" in chosen[0]:
        return recorded(read._replace(where={**read.where, "method": chosen[0]["same_as"]}))
    value = chosen[0][read.field]
    return list(value) if isinstance(value, list) else [value]


def as_printed(values: List[float]) -> str:
    low, high = f"{min(values):.2f}", f"{max(values):.2f}"
    return low if low == high else f"{low}-{high}"


def _id(where: Where) -> str:
    return "|".join(part for part in (where.doc, where.row, where.column, where.near) if part)


@pytest.mark.parametrize("where,reads", FIGURES, ids=[_id(where) for where, _ in FIGURES])
def test_printed_figure_is_its_records(where: Where, reads: Union[Read, Tuple[Read, ...]]):
    reads = (reads,) if isinstance(reads, Read) else reads
    values = [value for read in reads for value in recorded(read)]
    shown, expected = printed(where), as_printed(values)
    place = f"row {where.row!r}, column {where.column!r}" if where.row is not None else "its text"
    records = ", ".join(sorted({read.record for read in reads}))
    assert shown == expected, (f"{where.doc}, {place}{f' at {where.near!r}' if where.near else ''}: prints {shown}x, "
                               f"{records} holds {expected}x ({', '.join(f'{v:.4f}' for v in values)})")


def test_every_figure_of_a_checked_table_is_checked():
    """A figure added to a table this file checks needs its record here (or a place in UNRECORDED)."""
    mapped: Dict[Tuple[str, str, str], int] = {}
    for where in [where for where, _ in FIGURES] + UNRECORDED:
        if where.row is not None:
            key = (where.doc, where.row, where.column)
            mapped[key] = mapped.get(key, 0) + 1
    unchecked = []
    for doc in sorted({doc for doc, _, _ in mapped}):
        for table in _tables(doc):
            if not any((doc, row[0], column) in mapped for row in table[1:] for column in table[0]):
                continue
            for row in table[1:]:
                for column, cell in zip(table[0][1:], row[1:]):
                    figures = len(re.findall(FIGURE, cell))
                    if figures != mapped.get((doc, row[0], column), 0):
                        unchecked.append(f"{doc}, row {row[0]!r}, column {column!r}: {figures} figures, "
                                         f"{mapped.get((doc, row[0], column), 0)} mapped")
    assert not unchecked, "\n".join(unchecked)


@pytest.mark.parametrize("where", UNRECORDED, ids=[_id(where) for where in UNRECORDED])
def test_unrecorded_figures_are_where_they_are_said_to_be(where: Where):
    printed(where)

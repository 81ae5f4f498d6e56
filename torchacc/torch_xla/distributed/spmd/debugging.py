"""``torch_xla.distributed.spmd.debugging`` on torchacc: a sharding drawn as a table of devices
(``visualize_sharding`` of an HLO sharding string, ``visualize_tensor_sharding`` of a tensor, with
``rich``), and a tensor's sharding as an HLO V1 string (``construct_v1_sharding_str``)."""

from __future__ import annotations

import re

import numpy as np

__all__ = ["construct_v1_sharding_str", "visualize_sharding", "visualize_tensor_sharding"]

_TILED = re.compile(r"^\{devices=\[([0-9,]+)\]([0-9,]+)( last_tile_dim_replicate)?\}$")


def _cells(sharding):
    """The grid of the first two dimensions: ``(rows, cols, {(row, col): ids})``; a cell holds
    one device id, or the list of devices holding the same block (replicated or partially)."""
    from torchacc.torch_xla import runtime as xr

    if sharding in ("", "{replicated}"):
        return 1, 1, {(0, 0): list(range(xr.global_runtime_device_count()))}
    m = _TILED.match(sharding.strip())
    if m is None:
        raise ValueError(
            f"visualize_sharding: sharding {sharding!r} is not an HLO sharding string like "
            "'{devices=[2,2]0,1,2,3}', '{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}' or "
            "'{replicated}'"
        )
    dims = [int(d) for d in m.group(1).split(",")]
    ids = [int(i) for i in m.group(2).split(",")]
    if int(np.prod(dims)) != len(ids):
        raise ValueError(
            f"visualize_sharding: sharding {sharding!r} tiles {dims} but lists {len(ids)} devices"
        )
    grid = np.asarray(ids).reshape(dims)
    groups = m.group(3) is not None
    tile = dims[:-1] if groups else dims
    rows, cols = tile[0], tile[1] if len(tile) > 1 else 1
    grid = grid.reshape(rows, cols, -1)  # dims past the second (and the replication) last
    cells = {}
    for r in range(rows):
        for c in range(cols):
            members = grid[r, c].tolist()
            # a tile past the first two dimensions shows its first block's device
            cells[r, c] = members[: dims[-1]] if groups else members[0]
    return rows, cols, cells


def visualize_sharding(sharding, use_color=True, scale=1.0, min_width=9, max_width=80):
    """Print the devices of ``sharding`` (an HLO sharding string) as a ``rich`` table, one cell
    per block of the first two dimensions, and return the table."""
    try:
        import rich.align
        import rich.box
        import rich.console
        import rich.padding
        import rich.style
        import rich.table
    except ImportError:
        raise ValueError("visualize_sharding needs the `rich` package (pip install rich)") from None
    from torchacc.torch_xla import runtime as xr

    print(f"Visualizing {sharding} (showing up to the first two dimensions)")
    rows, cols, cells = _cells(sharding)
    console = rich.console.Console(width=max_width)
    plain = not (use_color and console.color_system is not None)
    table = rich.table.Table(
        show_header=False,
        show_lines=plain,
        padding=0,
        highlight=plain,
        pad_edge=False,
        box=rich.box.SQUARE if plain else None,
    )
    kind = xr.device_type()
    for r in range(rows):
        table.add_row(
            *[
                rich.padding.Padding(
                    rich.align.Align(f"{kind} {cells[r, c]}", "center", vertical="middle"),
                    (1, 1, 1, 1),
                    style=rich.style.Style(bgcolor=None, color=None),
                )
                for c in range(cols)
            ]
        )
    console.print(table, end="\n\n")
    return table


def construct_v1_sharding_str(t):
    """``t``'s sharding as an HLO V1 string (``{devices=[...]ids ...}``, ``{replicated}``):
    torchacc's sharding strings are V1 already."""
    from torchacc.torch_xla import _XLAC

    return _XLAC._get_xla_sharding_spec(t)


def visualize_tensor_sharding(t, **kwargs):
    """``visualize_sharding`` of tensor ``t``'s sharding (an XLAShardedTensor's global tensor)."""
    t = getattr(t, "global_tensor", t)
    return visualize_sharding(construct_v1_sharding_str(t), **kwargs)

"""The nominal host-device bandwidth of an accelerator: the PCIe link it negotiated, as Linux reports it.

No table of chips: the figure is read from the device's own link in sysfs
(`current_link_speed`, `current_link_width`), so it is right for the board
in hand, a GPU seated in a narrower slot included. Per lane: 2.5 and 5 GT/s
carry 8 bits in 10; 8 to 32 GT/s 128 in 130; 64 GT/s (PCIe 6) flits of 242
payload bytes in 256. That is the ceiling of one direction; a transfer
reaching half of it is doing well. A TPU's chips are found by Google's PCI
vendor id, a CUDA device by the bus address torch reports.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SYSFS = Path("/sys/bus/pci/devices")
GOOGLE_VENDOR = "0x1ae0"  # TPU chips on the PCI bus
_SPEED = re.compile(r"([0-9.]+)\s*GT/s")


def lane_bytes_per_s(gt_per_s: float) -> float:
    """One lane's payload rate at `gt_per_s` (line encoding taken off)."""
    efficiency = 0.8 if gt_per_s <= 5 else (242 / 256 if gt_per_s >= 64 else 128 / 130)
    return gt_per_s * 1e9 * efficiency / 8


def link(address: str, root: Path = SYSFS) -> dict[str, Any]:
    """The negotiated link of the PCI device at `address` (`0000:00:04.0`), or why it cannot be read."""
    where = root / address
    try:
        speed = (where / "current_link_speed").read_text().strip()
        width = int((where / "current_link_width").read_text().strip())
    except (OSError, ValueError) as e:
        return {"why_not": f"no PCIe link figures for {address} in {root} ({type(e).__name__})"}
    m = _SPEED.search(speed)
    if not m or width <= 0:
        return {"why_not": f"{address} reports an unreadable link: {speed!r} x{width}"}
    gt = float(m.group(1))
    return {"device": address, "link": f"PCIe {gt:g} GT/s x{width}", "bytes_per_s": lane_bytes_per_s(gt) * width}


def first_of_vendor(vendor: str, root: Path = SYSFS) -> str | None:
    try:
        found = sorted(p.name for p in root.iterdir() if (p / "vendor").read_text().strip() == vendor)
    except OSError:
        return None
    return found[0] if found else None


def nominal(backend: str, device_index: int = 0) -> dict[str, Any]:
    """The nominal one-way host-device bandwidth of the device a check used, or `why_not`."""
    if backend == "cuda":
        import torch

        p = torch.cuda.get_device_properties(device_index)
        if not hasattr(p, "pci_bus_id"):
            return {"why_not": "this torch does not report the GPU's PCI address"}
        return link(f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0")
    if backend in ("torch_xla", "torchtpu"):
        address = first_of_vendor(GOOGLE_VENDOR)
        if address is None:
            return {"why_not": "no TPU chip on the PCI bus (a CPU plugin's device memory is host memory)"}
        return link(address) | {"note": "the link of the first TPU chip on the bus"}
    return {"why_not": "the CPU backend: tensors stay in host memory"}

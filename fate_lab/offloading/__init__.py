"""The offloaded runtime's mechanisms: host store (RAM, or the SSD tier checked against full-content digests),
device slots, transfer engines, the HF hook-up, `Runtime` itself, opening a checkpoint offloaded
(`load.load_offloaded`) and the generated table of the families it serves (`support.py`).
"""

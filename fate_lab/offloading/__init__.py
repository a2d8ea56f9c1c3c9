"""The offloaded runtime's mechanisms: configuration, host store, device slots, transfer engines
and link profiles, the HF hook-up, counters, and `Runtime` itself.
"""

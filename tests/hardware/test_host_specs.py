"""Host specs and device specs as a user types them: peak bandwidth from memory type, rate and channels."""
import pytest

from fate_lab.hardware.devices import device
from fate_lab.hardware.disks import DISKS, disk
from fate_lab.hardware.host_specs import HOSTS, host_spec, parse_ram


def test_a_host_description_gives_its_peak_bandwidth():
    h = host_spec("ddr4-3200x2")
    assert h.socket_bandwidth() == 2 * 8 * 3200e6 and h.sockets == 1 and h.ram_gib is None
    s = host_spec("ddr5-4800x12,sockets=2,cores=32,ram=768GiB")
    assert s.socket_bandwidth() == 12 * 8 * 4800e6 and (s.sockets, s.cores, s.ram_gib) == (2, 32, 768)
    assert HOSTS["xeon_gold_6454s"].socket_bandwidth() == pytest.approx(307.2e9)
    assert host_spec("desktop_ddr4").with_ram(parse_ram("64GiB")).ram_bytes() == 64 * 2**30


@pytest.mark.parametrize("text", ["ddr9-3200x2", "ddr4-3200", "ddr4-3200x2,sockets=two", "ddr4-3200x0",
                                  "ddr4-3200x2,numa=2", "epyc"])
def test_a_host_that_cannot_parse_is_one_line_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"^--host ") as exc:
        host_spec(text)
    assert "\n" not in str(exc.value)


def test_a_device_spec_and_the_catalogue_name_every_number():
    d = device("mem=20GiB,bw=800GBps,fp16=103TFLOPS")
    assert (d.memory_gib, d.mem_bandwidth, d.fp16_flops, d.host_link) == (20, 800e9, 103e12, "pcie4_x16")
    assert device("mem=128GiB,bw=273GBps,fp16=100TFLOPS,unified=yes").unified
    with pytest.raises(ValueError, match=r"^--device 'rtx9999': give a device name"):
        device("rtx9999")
    with pytest.raises(ValueError, match="link='pcie9'"):
        device("mem=20GiB,bw=800GBps,fp16=103TFLOPS,link=pcie9")
    from fate_lab.hardware.devices import DEVICES

    assert all(d.source for d in DEVICES.values())


def test_a_disk_streams_at_the_rate_its_read_size_allows():
    d = disk("bw=3.5GBps,lat=100us,qd=4")
    assert d.stream_bandwidth(4096) == pytest.approx(4 * 4096 / (100e-6 + 4096 / 3.5e9))
    assert disk("nvme_gen4").queue_depth == 32
    with pytest.raises(ValueError, match=r"^--disk 'fast'"):
        disk("fast")


def test_a_disk_spec_names_its_read_ahead_window():
    assert disk("bw=3.5GBps").readahead == 128 << 10  # Linux's default read_ahead_kb
    assert disk("bw=3.5GBps,ra=8MiB").readahead == 8 << 20
    assert disk("bw=3.5GBps,ra=512KiB").readahead == 512 << 10
    assert all(d.readahead == 128 << 10 for d in DISKS.values())
    for bad in ("bw=3.5GBps,ra=8", "bw=3.5GBps,ra=1KiB", "bw=3.5GBps,ra=8GBps"):
        with pytest.raises(ValueError, match=r"^--disk 'bw=3.5GBps,ra="):
            disk(bad)


def test_the_read_ahead_window_of_a_file_comes_from_its_block_device(tmp_path):
    from fate_lab.fit.disk import readahead_of

    assert readahead_of("/proc/self/status") is None  # no block device under /proc
    ra = readahead_of(tmp_path)
    assert ra is None or (ra >= 0 and ra % 1024 == 0)

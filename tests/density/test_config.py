"""The [density] reclaim settings: read, checked, and left alone when absent."""
from __future__ import annotations

import pytest

from shoal.config import load_settings
from shoal.core.errors import InvalidArgument


def _load(tmp_path, monkeypatch, text: str):
    cfg = tmp_path / "config.toml"
    cfg.write_text(text)
    monkeypatch.setenv("SHOAL_CONFIG", str(cfg))
    return load_settings(tmp_path)


def test_defaults_enable_nothing(tmp_path, monkeypatch):
    s = _load(tmp_path, monkeypatch, "")
    assert (s.zram_mb, s.idle_pause_s, s.reclaim_after_s, s.sandbox_swap) == (0, 0.0, 0.0, 0.0)
    assert (s.zram_algorithm, s.zram_priority, s.reclaim_target) == ("lz4", 100, 0.75)


def test_values_are_read(tmp_path, monkeypatch):
    s = _load(tmp_path, monkeypatch, '[density]\nzram_mb = 4096\nzram_algorithm = "lzo-rle"\nzram_priority = 5\n'
                                     "sandbox_swap = 0.5\nidle_pause_s = 30\nreclaim_after_s = 120\n"
                                     "reclaim_target = 0.9\nanother_density_key = true\n")
    assert (s.zram_mb, s.zram_algorithm, s.zram_priority, s.sandbox_swap) == (4096, "lzo-rle", 5, 0.5)
    assert (s.idle_pause_s, s.reclaim_after_s, s.reclaim_target) == (30.0, 120.0, 0.9)
    assert "density" not in s.extra


@pytest.mark.parametrize("line", ["zram_mb = -1", "zram_mb = 1.5", "zram_mb = true", 'zram_mb = "1G"',
                                  "reclaim_target = 0", "reclaim_target = 1.5", "idle_pause_s = -3",
                                  "zram_algorithm = 4", "zram_priority = 2.5"])
def test_bad_values_are_typed_errors(tmp_path, monkeypatch, line):
    with pytest.raises(InvalidArgument, match=line.split()[0]):
        _load(tmp_path, monkeypatch, f"[density]\n{line}\n")


def test_density_must_be_a_table(tmp_path, monkeypatch):
    with pytest.raises(InvalidArgument, match="density"):
        _load(tmp_path, monkeypatch, "density = 3\n")

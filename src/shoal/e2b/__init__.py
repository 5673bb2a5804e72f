"""An E2B-compatible endpoint over any Shoal backend: `shoal e2b serve` (docs/e2b.md)."""

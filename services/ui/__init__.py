"""The operations console: a read-only JSON "Tracker" API and a static web page,
served by the controller on ``--ui-port`` (docs/ui.md)."""

"""The worker process and its watchdog: owned ranges, receiving, sending, the progress block
shared with the watchdog, and overrun bookkeeping."""

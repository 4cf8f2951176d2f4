"""The runtime: range workers, injectors and the local runner that drives them."""

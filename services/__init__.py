"""The processes: CLI, controller and worker. Only this package touches gRPC."""

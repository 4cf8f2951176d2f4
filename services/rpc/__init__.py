"""What every millwheel process shares: gRPC server and channel set-up, authentication and TLS,
reflection, health, status codes, proto conversion, and the links to controllers and workers."""

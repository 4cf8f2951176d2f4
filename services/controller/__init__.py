"""The controller process: registry, key-range assignment, leadership, the Inject path,
queries and the replay of dead letters."""

"""pdserve: the top floor. The `pdserve` CLI, the launchers (Ray, in-process) and the load generator."""

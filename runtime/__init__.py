"""The engine's processes: the client-side Engine that spawns the ranks, and each rank's main loop. It sits above
`worker` (the plain engine core) and `speculative` (EAGLE), and chooses between them, so neither imports the other's
host."""

"""LAN membership: zeroconf advertise/browse of workers and the cluster token (auth)."""

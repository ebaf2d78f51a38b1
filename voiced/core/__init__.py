"""The session core: what every front door shares, knowing no transport (see README, Architecture)."""

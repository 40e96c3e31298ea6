"""pdsim package."""

"""pdmaster package."""

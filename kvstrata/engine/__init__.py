"""Models, weight loading, attention backends, scheduler, sampler, drift monitor."""

"""Models: any nn.Module (or a function returning one) whose signature is its config; see README "Bring your own"."""

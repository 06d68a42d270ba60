"""Code the tests share: fakes, fixtures helpers and test-only targets."""

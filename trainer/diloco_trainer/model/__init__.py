"""The models a learner trains and the inner optimizer."""

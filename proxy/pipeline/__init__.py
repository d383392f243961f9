"""The request pipeline: route, match, decide, forward, pace, feed back, answer, account."""

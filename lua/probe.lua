-- probe.lua: can this store take a write through a script, as acquire.lua must?
--
-- PING is answered by a read-only replica, by a server out of memory under
-- `noeviction` and by one whose writes are paused (CLIENT PAUSE WRITE): every
-- acquire would still fail. Readiness asks this instead: a script that writes.
--
-- KEYS[1]   a key of the vendor's slot (its namespace), written with a short TTL
-- Returns 1.

redis.call('SET', KEYS[1], '1', 'PX', 1000)
return 1

-- django_tokenbucket: the database backend's fast path on PostgreSQL, version 3.
--
-- Installed by migration 0004 on PostgreSQL only. A change of behaviour gets a new
-- version (_v4) and a new migration, so that a deployment whose code and schema are
-- briefly out of step never runs SQL the code does not expect: code that finds no
-- function of its version takes the portable path.
--
-- Two ports of algorithms.token_bucket and algorithms.fixed_window live here:
--
-- * django_tokenbucket_single_v3: the common decision (one limit, one key, in
--   autocommit), in bigint: it reads the row, decides, and writes only when allowed,
--   with a compare-and-set. It is exact only inside bounds it shares with its caller
--   (times within +-2^61, every product below 2^62); outside them, or when the
--   compare-and-set loses a race, it decides nothing and the caller asks the general
--   function below.
-- * django_tokenbucket_step_v3 and django_tokenbucket_decide_v3: the general case
--   (several limits or keys, all or nothing: backends.base.decide_all), in numeric so
--   that products past 64 bits stay exact, as Python's integers are.
--
-- tests/test_pg_fast_path.py replays generated traces through both and through Python
-- and requires identical decisions, values, waits and stored states.
--
-- Why the single decision is a PL/pgSQL function and not one plain statement (CTEs that
-- read, decide and compare-and-set): written so, with the arithmetic as SQL, it took
-- ~2 ms to plan, which every call behind PgBouncer pays, and ~200 us a call prepared
-- (the executor builds its ModifyTable and subquery nodes again on each call). PL/pgSQL
-- keeps its plans in the server session, so they serve pooled clients too, and the
-- call itself is cheap to plan.
--
-- Both take algorithms.CLOCK_SKEW_TOLERANCE as the argument tolerance: a clock up to
-- that far behind the stored time lags another host's, and decides at the stored time
-- (its non-zero waits longer by the lag); a clock further back jumped.

-- How a row is looked up. PL/pgSQL keeps a connection's plans for its life, and its
-- statements' parameters make them generic plans after a few calls. Planned while the
-- table was small, "name = $1 AND key = $2" costs the same through the (name, ts) index
-- as through the unique (name, key) one, and the plan kept then reads every row of the
-- limit on each call as the table grows (14 ms a decision at 10^5 rows; v2 planned
-- every call instead, ~50 us each). Asked for key as a range, in key order, with LIMIT 1,
-- only the unique index gives that order without a sort, so every plan uses it; for a
-- deterministic collation the range holds exactly the equal key.

CREATE OR REPLACE FUNCTION django_tokenbucket_single_v3(
    row_name text, row_key text, row_label text, kind text, rate bigint, period bigint,
    capacity bigint, lowest bigint, count bigint, fresh_ts bigint, pinned_now bigint, tolerance bigint,
    exact_from bigint, apply boolean, async_commit boolean,
    OUT decided boolean, OUT allowed boolean, OUT amount bigint, OUT wait bigint, OUT full_wait bigint,
    OUT decided_at bigint, OUT server_pid integer
) LANGUAGE plpgsql VOLATILE
AS $$
-- One limit, one key: algorithms.token_bucket (kind 't') or algorithms.fixed_window ('f'),
-- in bigint. lowest NULL: reservations uncapped. fresh_ts: the fresh state's ts, which
-- for a window is also its offset. decided false: nothing was decided or written, and
-- the caller asks django_tokenbucket_decide_v3 (the row or the clock is beyond the bounds
-- checked below, or another decision changed the row between this one's read and write).
--
-- Exact within bounds the caller and this function share: the caller sends only
-- configs and counts for which (capacity - exact_from + count + 1) * period + rate
-- <= 2^62, and this function decides only times within +-2^61 and stored values of at
-- least exact_from. Then no product or sum below leaves 64 bits. Operands are
-- non-negative where they are divided, so / is Python's //, and a ceiling is
-- (n + d - 1) / d. Whether a bucket refills to full is decided from the time it needs
-- (deficit * period / rate), not from rate * elapsed, ~2^100 for a bucket idle since
-- the epoch.
DECLARE
    found_id bigint;
    state_value bigint;
    state_ts bigint;
    at bigint;
    lag bigint := 0;
    went_back boolean;
    since bigint;
    stored bigint;
    elapsed bigint;
    deficit bigint;
    gained bigint;
    current bigint;
    current_ts bigint;
    after bigint;
    window_start bigint;
    windows bigint;
    target bigint;
    new_value bigint;
    new_ts bigint;
BEGIN
    server_pid := pg_backend_pid();
    -- See "How a row is looked up" above.
    SELECT r.id, r.value, r.ts INTO found_id, state_value, state_ts
      FROM django_tokenbucket_ratelimit r
     WHERE r.name = row_name AND r.key >= row_key AND r.key <= row_key ORDER BY r.key LIMIT 1;
    -- Read after the row, so that no later decision can carry an earlier time than the
    -- state it found.
    decided_at := COALESCE(pinned_now, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint);
    IF found_id IS NULL THEN
        state_value := capacity;
        state_ts := fresh_ts;
    END IF;
    decided := decided_at BETWEEN -2305843009213693952 AND 2305843009213693952
               AND state_ts BETWEEN -2305843009213693952 AND 2305843009213693952
               AND state_value >= exact_from;
    IF NOT decided THEN
        RETURN;
    END IF;

    at := decided_at;
    -- A clock up to tolerance behind the stored time lags another host's: it decides
    -- at the stored time, and its non-zero waits are longer by the lag.
    IF at < state_ts AND at >= state_ts - tolerance THEN
        lag := state_ts - at;
        at := state_ts;
    END IF;
    went_back := at < state_ts;

    IF kind = 't' THEN
        -- A clock that jumped back credits nothing for the lost time.
        since := CASE WHEN went_back THEN at ELSE state_ts END;
        stored := LEAST(state_value, capacity);
        elapsed := at - since;
        deficit := capacity - stored;
        IF elapsed >= (deficit * period + rate - 1) / rate THEN
            current := capacity;
            current_ts := at;
        ELSE
            -- Keep the refill phase: date the value back by the time that earned its fraction.
            gained := rate * elapsed;
            current := stored + gained / period;
            current_ts := at - gained % period / rate;
        END IF;
        after := current - count;
        allowed := lowest IS NULL OR after >= lowest;
        IF allowed THEN
            amount := after;
            IF after < 0 THEN
                wait := current_ts - at + (-after * period + rate - 1) / rate;
            END IF;
            full_wait := CASE WHEN after >= capacity THEN 0
                              ELSE current_ts - at + ((capacity - after) * period + rate - 1) / rate END;
            new_value := after;
            new_ts := current_ts;
        ELSE
            -- Measured from the stored state, not the re-dated one, so the wait is exact.
            amount := current;
            wait := CASE WHEN stored >= count + lowest THEN 0
                         ELSE since - at + ((count + lowest - stored) * period + rate - 1) / rate END;
            full_wait := CASE WHEN stored >= capacity THEN 0
                              ELSE since - at + (deficit * period + rate - 1) / rate END;
            IF went_back THEN
                new_value := stored;
                new_ts := at;
            END IF;
        END IF;
    ELSE
        -- % takes the sign of the dividend: add a period before the second one.
        window_start := at - ((at - fresh_ts) % period + period) % period;
        -- Window starts since the stored one; a clock gone back finds none.
        windows := CASE WHEN window_start > state_ts THEN (window_start - state_ts + period - 1) / period ELSE 0 END;
        current := CASE WHEN state_value >= capacity OR windows >= (capacity - state_value + rate - 1) / rate
                        THEN capacity ELSE state_value + windows * rate END;
        after := current - count;
        allowed := lowest IS NULL OR after >= lowest;
        IF allowed THEN
            amount := after;
            target := 0;
            new_value := after;
            new_ts := window_start;
        ELSE
            amount := current;
            target := count + lowest;
            IF went_back THEN
                new_value := LEAST(state_value, capacity);
                new_ts := window_start;
            END IF;
        END IF;
        -- time_to_reach: whole windows until enough are credited.
        IF NOT allowed OR after < 0 THEN
            wait := CASE WHEN amount >= target THEN 0
                         ELSE window_start - at + (target - amount + rate - 1) / rate * period END;
        END IF;
        full_wait := CASE WHEN amount >= capacity THEN 0
                          ELSE window_start - at + (capacity - amount + rate - 1) / rate * period END;
    END IF;
    IF lag > 0 THEN
        wait := CASE WHEN wait <> 0 THEN wait + lag ELSE wait END;
        full_wait := CASE WHEN full_wait <> 0 THEN full_wait + lag ELSE 0 END;
    END IF;

    -- Write only what changes. Nothing to write (a denial, a check): no row is touched,
    -- the transaction takes no xid, and its commit writes no WAL and waits for no flush.
    IF apply AND new_value IS NOT NULL
       AND (found_id IS NULL OR new_value <> state_value OR new_ts <> state_ts) THEN
        IF async_commit THEN
            -- Transaction-local: this statement's commit does not wait for the WAL flush.
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;
        -- Compare-and-set: if another decision committed in between, this matches
        -- nothing (the UPDATE waits for its row lock, then finds the row changed).
        IF found_id IS NULL THEN
            INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts)
            VALUES (row_name, row_key, row_label, new_value, new_ts)
            ON CONFLICT (name, key) DO NOTHING;
        ELSE
            UPDATE django_tokenbucket_ratelimit r SET value = new_value, ts = new_ts
             WHERE r.id = found_id AND r.value = state_value AND r.ts = state_ts;
        END IF;
        decided := FOUND;
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION django_tokenbucket_step_v3(
    kind text, rate numeric, period numeric, capacity numeric, lowest numeric, count numeric,
    window_offset numeric, state_value numeric, state_ts numeric, now numeric, tolerance numeric,
    OUT allowed boolean, OUT value numeric, OUT retry_after numeric, OUT full_after numeric,
    OUT new_value numeric, OUT new_ts numeric
) LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
-- One limit, one state: algorithms.token_bucket ('t') or algorithms.fixed_window ('f').
-- lowest is how low the value may go (NULL: reservations uncapped). new_value/new_ts are
-- the state to store, NULL when nothing changes. Divisors (rate, period) are positive, so
-- floor division is div() less one where the remainder is negative, and a ceiling is
-- div() plus one where it is positive.
DECLARE
    lag numeric := 0;
    went_back boolean;
    since numeric;
    stored numeric;
    gained numeric;
    credited numeric;
    current numeric;
    current_ts numeric;
    after numeric;
    window_start numeric;
    windows numeric;
    target numeric;
BEGIN
    -- tolerance (algorithms.CLOCK_SKEW_TOLERANCE): a clock up to this far behind the
    -- stored time lags another host's. It decides at the stored time, and its non-zero
    -- waits are longer by the lag.
    IF now < state_ts AND now >= state_ts - tolerance THEN
        lag := state_ts - now;
        now := state_ts;
    END IF;
    went_back := now < state_ts;

    IF kind = 'f' THEN
        window_start := now - (mod(now - window_offset, period)
                               + CASE WHEN mod(now - window_offset, period) < 0 THEN period ELSE 0 END);
        windows := GREATEST(0, div(window_start - state_ts, period)
                               + CASE WHEN mod(window_start - state_ts, period) > 0 THEN 1 ELSE 0 END);
        current := LEAST(capacity, state_value + windows * rate);
        after := current - count;
        allowed := lowest IS NULL OR after >= lowest;
        IF allowed THEN
            value := after;
            new_value := after;
            new_ts := window_start;
        ELSE
            value := current;
            IF went_back THEN
                new_value := LEAST(state_value, capacity);
                new_ts := window_start;
            END IF;
        END IF;
        -- time_to_reach(target) from the value now: whole windows until enough are credited.
        target := CASE WHEN allowed THEN 0 ELSE count + lowest END;
        IF NOT allowed OR after < 0 THEN
            retry_after := CASE WHEN value >= target THEN 0 ELSE
                window_start + (div(target - value, rate) + CASE WHEN mod(target - value, rate) > 0 THEN 1 ELSE 0 END)
                               * period - now END;
        END IF;
        full_after := CASE WHEN value >= capacity THEN 0 ELSE
            window_start + (div(capacity - value, rate) + CASE WHEN mod(capacity - value, rate) > 0 THEN 1 ELSE 0 END)
                           * period - now END;
    ELSE
        -- A clock that jumped backwards credits nothing for the lost time, and measuring from
        -- now keeps it from locking anybody out until it catches up.
        since := CASE WHEN went_back THEN now ELSE state_ts END;
        stored := LEAST(state_value, capacity);
        gained := rate * (now - since);
        credited := div(gained, period);
        IF stored + credited >= capacity THEN
            current := capacity;
            current_ts := now;
        ELSE
            -- Keep the refill phase: date the value back by the time that earned its fraction.
            current := stored + credited;
            current_ts := now - div(gained - credited * period, rate);
        END IF;
        after := current - count;
        allowed := lowest IS NULL OR after >= lowest;
        IF allowed THEN
            value := after;
            new_value := after;
            new_ts := current_ts;
            IF after < 0 THEN
                retry_after := current_ts + div(-after * period, rate)
                               + CASE WHEN mod(-after * period, rate) > 0 THEN 1 ELSE 0 END - now;
            END IF;
            full_after := CASE WHEN after >= capacity THEN 0 ELSE
                current_ts + div((capacity - after) * period, rate)
                + CASE WHEN mod((capacity - after) * period, rate) > 0 THEN 1 ELSE 0 END - now END;
        ELSE
            -- Measured from the stored state, not the re-dated one, so the wait is exact.
            value := current;
            target := count + lowest;
            retry_after := CASE WHEN stored >= target THEN 0 ELSE
                since + div((target - stored) * period, rate)
                + CASE WHEN mod((target - stored) * period, rate) > 0 THEN 1 ELSE 0 END - now END;
            full_after := CASE WHEN stored >= capacity THEN 0 ELSE
                since + div((capacity - stored) * period, rate)
                + CASE WHEN mod((capacity - stored) * period, rate) > 0 THEN 1 ELSE 0 END - now END;
            IF went_back THEN
                new_value := stored;
                new_ts := now;
            END IF;
        END IF;
    END IF;

    IF lag > 0 THEN
        retry_after := CASE WHEN retry_after > 0 THEN retry_after + lag ELSE retry_after END;
        full_after := CASE WHEN full_after > 0 THEN full_after + lag ELSE full_after END;
    END IF;
END
$$;

-- The general decision (limit_many, shards, and whatever the single statement leaves):
-- one statement in autocommit instead of the portable path's BEGIN, SELECT ... FOR
-- UPDATE, UPDATE and COMMIT with the rows locked throughout.
--   1. Read the rows without a lock and decide with the database clock read after them.
--   2. Nothing to write (a denial, a check): return. The transaction gets no xid, so its
--      commit writes no WAL and waits for no flush.
--   3. One row to write: compare-and-set it (UPDATE ... WHERE value and ts are still what
--      was read, or INSERT ... ON CONFLICT DO NOTHING for a new row). The UPDATE locks the
--      row; if another decision committed in between, it matches nothing.
--   4. Otherwise (several rows, or a lost compare-and-set): lock every row FOR UPDATE in
--      the order given (the caller sorts them, as the portable path does, so the two
--      paths cannot deadlock each other), read the clock again, decide and write. Under
--      contention this is the portable path, run inside the server.
CREATE OR REPLACE FUNCTION django_tokenbucket_decide_v3(
    row_names text[], row_keys text[], row_labels text[],
    request_rows integer[], kinds text[], rates bigint[], periods bigint[], capacities bigint[],
    lowests bigint[], counts bigint[], window_offsets bigint[], fresh_values bigint[], fresh_ts bigint[],
    apply boolean, pinned_now bigint, async_commit boolean, tolerance bigint
) RETURNS TABLE (decided_at bigint, allowed numeric[], amounts numeric[], waits numeric[], full_waits numeric[])
LANGUAGE plpgsql VOLATILE
AS $$
-- Decide every request all or nothing (backends.base.decide_all). Rows are distinct
-- (name, key) pairs in locking order; request_rows[i] is the row of request i (1-based).
-- lowests[i] NULL: reservations uncapped. pinned_now NULL: the database clock.
-- Returns the time used and, per request, allowed (1/0), value, retry_after (NULL: None)
-- and full_after.
#variable_conflict use_column
DECLARE
    n_rows integer := cardinality(row_names);
    n_requests integer := cardinality(request_rows);
    locked boolean := false;
    row_ids bigint[];
    stored_values numeric[];
    stored_ts numeric[];
    current_values numeric[];
    current_ts numeric[];
    write_values numeric[];
    write_ts numeric[];
    rebased_values numeric[];
    rebased_ts numeric[];
    first_request integer[];
    created boolean[];
    out_allowed numeric[];
    out_values numeric[];
    out_waits numeric[];
    out_full numeric[];
    now numeric;
    all_allowed boolean;
    writing boolean;
    found_id bigint;
    found_value bigint;
    found_ts bigint;
    r integer;
    i integer;
    step record;
BEGIN
    FOR i IN 1..n_requests LOOP
        IF first_request[request_rows[i]] IS NULL THEN
            first_request[request_rows[i]] := i;
        END IF;
    END LOOP;

    LOOP
        FOR r IN 1..n_rows LOOP
            found_id := NULL;
            IF locked THEN
                SELECT id, value, ts INTO found_id, found_value, found_ts
                  FROM django_tokenbucket_ratelimit
                 WHERE name = row_names[r] AND key >= row_keys[r] AND key <= row_keys[r]
                 ORDER BY key LIMIT 1 FOR UPDATE;
                IF found_id IS NULL THEN
                    -- Created now, in locking order as the portable path does, so that
                    -- it is locked too. Many callers may create it at once: one insert
                    -- wins, and the others wait for it and then lock the row it made.
                    INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts)
                    VALUES (row_names[r], row_keys[r], row_labels[r],
                            fresh_values[first_request[r]], fresh_ts[first_request[r]])
                    ON CONFLICT (name, key) DO NOTHING
                    RETURNING id INTO found_id;
                    IF found_id IS NOT NULL THEN
                        -- Ours: decided as missing (each request's own fresh state) and
                        -- deleted again below unless something is written to it.
                        created[r] := true;
                        found_value := NULL;
                        found_ts := NULL;
                    ELSE
                        SELECT id, value, ts INTO found_id, found_value, found_ts
                          FROM django_tokenbucket_ratelimit
                         WHERE name = row_names[r] AND key >= row_keys[r] AND key <= row_keys[r]
                         ORDER BY key LIMIT 1 FOR UPDATE;
                        IF found_id IS NULL THEN
                            RAISE EXCEPTION 'rate limit %: the row vanished while being created', row_names[r];
                        END IF;
                    END IF;
                END IF;
            ELSE
                SELECT id, value, ts INTO found_id, found_value, found_ts
                  FROM django_tokenbucket_ratelimit
                 WHERE name = row_names[r] AND key >= row_keys[r] AND key <= row_keys[r] ORDER BY key LIMIT 1;
            END IF;
            row_ids[r] := found_id;
            stored_values[r] := found_value;
            stored_ts[r] := found_ts;
        END LOOP;
        -- Read after every row is read (or locked), so that no later decision can carry
        -- an earlier time than the state it found.
        now := COALESCE(pinned_now, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint);

        current_values := stored_values;
        current_ts := stored_ts;
        rebased_values := array_fill(NULL::numeric, ARRAY[n_requests]);
        rebased_ts := rebased_values;
        all_allowed := true;
        FOR i IN 1..n_requests LOOP
            r := request_rows[i];
            step := django_tokenbucket_step_v3(
                kinds[i], rates[i], periods[i], capacities[i], lowests[i], counts[i], window_offsets[i],
                COALESCE(current_values[r], fresh_values[i]), COALESCE(current_ts[r], fresh_ts[i]), now, tolerance);
            out_allowed[i] := CASE WHEN step.allowed THEN 1 ELSE 0 END;
            out_values[i] := step.value;
            out_waits[i] := step.retry_after;
            out_full[i] := step.full_after;
            IF step.allowed THEN
                current_values[r] := step.new_value;
                current_ts[r] := step.new_ts;
            ELSE
                all_allowed := false;
                -- Only set where a clock went backwards: the state to store even so.
                rebased_values[i] := step.new_value;
                rebased_ts[i] := step.new_ts;
            END IF;
        END LOOP;

        write_values := array_fill(NULL::numeric, ARRAY[n_rows]);
        write_ts := write_values;
        IF all_allowed THEN
            FOR r IN 1..n_rows LOOP
                IF current_values[r] IS NOT NULL
                   AND (stored_values[r] IS NULL OR current_values[r] <> stored_values[r]
                        OR current_ts[r] <> stored_ts[r]) THEN
                    write_values[r] := current_values[r];
                    write_ts[r] := current_ts[r];
                END IF;
            END LOOP;
        ELSE
            -- Denied: each request allowed alone is reported as its limit stands, and only
            -- a state rebased after a backward clock jump is written.
            FOR i IN 1..n_requests LOOP
                r := request_rows[i];
                IF out_allowed[i] = 1 THEN
                    step := django_tokenbucket_step_v3(
                        kinds[i], rates[i], periods[i], capacities[i], 0, 0, window_offsets[i],
                        COALESCE(stored_values[r], fresh_values[i]), COALESCE(stored_ts[r], fresh_ts[i]), now, tolerance);
                    out_allowed[i] := CASE WHEN step.allowed THEN 1 ELSE 0 END;
                    out_values[i] := step.value;
                    out_waits[i] := step.retry_after;
                    out_full[i] := step.full_after;
                ELSIF rebased_values[i] IS NOT NULL THEN
                    write_values[r] := rebased_values[i];
                    write_ts[r] := rebased_ts[i];
                END IF;
            END LOOP;
        END IF;

        IF NOT apply THEN
            write_values := array_fill(NULL::numeric, ARRAY[n_rows]);
        END IF;
        writing := cardinality(array_remove(write_values, NULL)) > 0;

        IF writing AND async_commit THEN
            -- Transaction-local: this statement's commit does not wait for the WAL flush.
            PERFORM set_config('synchronous_commit', 'off', true);
        END IF;

        IF writing AND NOT locked THEN
            IF n_rows = 1 THEN
                IF row_ids[1] IS NULL THEN
                    INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts)
                    VALUES (row_names[1], row_keys[1], row_labels[1], write_values[1], write_ts[1])
                    ON CONFLICT (name, key) DO NOTHING;
                ELSE
                    UPDATE django_tokenbucket_ratelimit SET value = write_values[1], ts = write_ts[1]
                     WHERE id = row_ids[1] AND value = stored_values[1] AND ts = stored_ts[1];
                END IF;
                IF FOUND THEN
                    RETURN QUERY SELECT now::bigint, out_allowed, out_values, out_waits, out_full;
                    RETURN;
                END IF;
            END IF;
            -- Another decision got there first (or several rows must change together):
            -- decide again under the row locks.
            locked := true;
            CONTINUE;
        END IF;

        -- Under the locks, or with nothing to write: store what changed, and remove the
        -- rows this call created that it does not write (only ever made under the locks).
        FOR r IN 1..n_rows LOOP
            IF write_values[r] IS NOT NULL THEN
                UPDATE django_tokenbucket_ratelimit SET value = write_values[r], ts = write_ts[r]
                 WHERE id = row_ids[r];
            ELSIF created[r] THEN
                DELETE FROM django_tokenbucket_ratelimit WHERE id = row_ids[r];
            END IF;
        END LOOP;
        RETURN QUERY SELECT now::bigint, out_allowed, out_values, out_waits, out_full;
        RETURN;
    END LOOP;
END
$$;

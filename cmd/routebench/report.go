package main

import (
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/lightspeed-dev/incus-provider/controller"
)

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d)/float64(time.Millisecond)) }
func us(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d)/float64(time.Microsecond)) }
func mibps(bps float64) string  { return fmt.Sprintf("%.0f MiB/s", bps/(1<<20)) }

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

// printWakeRows prints a row per wake measurement. deploy/dev/wakebench.sh
// reads these rows from this build's output and from older builds': keep
// their shape.
func (r *report) printWakeRows(tw io.Writer) {
	for _, wk := range r.wakes {
		s := summarize(wk.latencies)
		target, ok := "p50 ≤ 50 ms", s.p50 <= 50*time.Millisecond
		if wk.from == controller.PowerStopped {
			target, ok = "p50 ≤ 500 ms, first dial upgraded", s.p50 <= 500*time.Millisecond && wk.firstOK == len(wk.latencies)+len(wk.refusals)
		}
		if s.n == 0 {
			ok = false
		}
		_, _ = fmt.Fprintf(tw, "%s → upgraded (first dial upgraded %d/%d)\t%d\t%s\t%s\t%s\t%s\t%s\n", wk.from, wk.firstOK,
			wk.firstOK+len(wk.refusals), s.n, ms(s.p50), ms(s.p95), ms(s.mean), target, verdict(ok))
	}
}

// printWakeBreakdown divides each upgraded first dial of the wakes by the
// provider's own trace (wake.Trace.Breakdown).
func (r *report) printWakeBreakdown(w io.Writer) {
	_, _ = fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "wake breakdown, p50 (p95)\ttraced\toutside: dial → upgraded\tprovider: arrival → upgrade written\tincus\tof it, the record after the answer\tdaemon\tprovider share\tanswered → relay dial\tpoll gap (in daemon)\tprobes\tgoal\tresult")
	for _, wk := range r.wakes {
		var outside, total, incus, record, daemon, prov, tail, gap, probes []time.Duration
		for _, t := range wk.traces {
			if !t.rec.Complete {
				continue
			}
			outside = append(outside, t.outside)
			total = append(total, time.Duration(t.rec.TotalNs))
			incus = append(incus, time.Duration(t.rec.IncusNs))
			record = append(record, time.Duration(t.rec.RecordNs))
			daemon = append(daemon, time.Duration(t.rec.DaemonNs))
			prov = append(prov, time.Duration(t.rec.ProviderNs))
			tail = append(tail, time.Duration(t.rec.GuestDialAt-t.rec.AnsweredAt))
			gap = append(gap, time.Duration(t.rec.PollGapNs))
			probes = append(probes, time.Duration(t.rec.Probes))
		}
		pp := func(d []time.Duration) string {
			s := summarize(d)
			return fmt.Sprintf("%s (%s)", ms(s.p50), ms(s.p95))
		}
		ps, pr := summarize(prov), summarize(probes)
		_, _ = fmt.Fprintf(tw, "from %s\t%d/%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d (%d)\tprovider share ≤ 2 ms p50\t%s\n", wk.from, len(total), wk.firstOK,
			pp(outside), pp(total), pp(incus), pp(record), pp(daemon), pp(prov), pp(tail), pp(gap), int64(pr.p50), int64(pr.p95),
			verdict(ps.n > 0 && ps.n == wk.firstOK && ps.p50 <= 2*time.Millisecond))
	}
	_ = tw.Flush()
	_, _ = fmt.Fprintln(w, "Each upgraded first dial divided by the provider's own clock (wake.Trace): incus is the time inside")
	_, _ = fmt.Fprintln(w, "Targets.Wake: the unfreeze or start and its operation, then the record of the use's request, which the relay")
	_, _ = fmt.Fprintln(w, "waits for (the record column is the part after the daemon's answer); daemon is the wait for the")
	_, _ = fmt.Fprintln(w, "daemon's first answer to the readiness probe once Incus is done, plus the relay's own dial and handshake;")
	_, _ = fmt.Fprintln(w, "the provider's share is the rest of arrival → upgrade written. Each is its own order statistic: the p50s need")
	_, _ = fmt.Fprintln(w, "not add up. The poll gap is the probe's last backoff pause, counted as the daemon's: the most the polling adds.")
}

func (r *report) print(w io.Writer) {
	_, _ = fmt.Fprintf(w, "routebench: %s\n\n", r.header)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "measure\tn\tp50\tp95\tmean\ttarget\tresult")
	if r.wakesOnly {
		r.printWakeRows(tw)
		_ = tw.Flush()
		r.printWakeBreakdown(w)
		r.printRefusals(w)
		return
	}
	cs := summarize(r.cycles.wakes)
	_, _ = fmt.Fprintf(tw, "pause → wake (one dial) → close → setPower paused: %d/%d cycles completed\t%d\t%s\t%s\t%s\tall cycles complete\t%s\n",
		r.cycles.completed, r.cycles.asked, cs.n, ms(cs.p50), ms(cs.p95), ms(cs.mean), verdict(r.cycles.asked > 0 && r.cycles.completed == r.cycles.asked))
	r.printWakeRows(tw)
	d, rl, pp := r.rtt[pathDirect], r.rtt[pathRelayed], r.rtt[pathPipe]
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, direct\t%d\t%s\t%s\t%s\t\t\n", d.n, us(d.p50), us(d.p95), us(d.mean))
	ratio := float64(rl.p50) / float64(d.p50)
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, relayed\t%d\t%s\t%s\t%s\t≤ 1.5× direct (p50)\t%.2f× %s\n", rl.n, us(rl.p50), us(rl.p95), us(rl.mean), ratio, verdict(ratio <= 1.5))
	_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, plain pipe (Go, in the provider)\t%d\t%s\t%s\t%s\t\t%.2f× direct\n", pp.n, us(pp.p50), us(pp.p95), us(pp.mean), float64(pp.p50)/float64(d.p50))
	if sc, ok := r.rtt[pathSocat]; ok {
		_, _ = fmt.Fprintf(tw, "round trip, 64-byte messages, socat (C byte relay, the floor)\t%d\t%s\t%s\t%s\t\t%.2f× direct\n", sc.n, us(sc.p50), us(sc.p95), us(sc.mean), float64(sc.p50)/float64(d.p50))
		q := float64(rl.p50) / float64(sc.p50)
		_, _ = fmt.Fprintf(tw, "round trip, relayed against socat (p50)\t\t\t\t\t≤ 1.05× socat\t%.2f× %s\n", q, verdict(q <= 1.05))
	}
	_ = tw.Flush()

	_, _ = fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "throughput\tmessage\tdirect\trelayed\tplain pipe\tsocat (floor)\trelayed/direct\tpipe/direct\tsocat/direct\ttarget\tresult")
	for _, t := range r.throughput {
		ratio := t.bps[pathRelayed] / t.bps[pathDirect]
		target, result := "", ""
		switch {
		case t.direction == "requests":
			// Issue 11: one large request at a time, answered by the daemon.
			target, result = "≥ 0.95× direct", verdict(ratio >= 0.95)
		case t.label == "1 MiB":
			target, result = "≥ 0.95× direct", verdict(ratio >= 0.95)
		}
		socat, socatRatio := "–", "–"
		if v, ok := t.bps[pathSocat]; ok {
			socat, socatRatio = fmt.Sprintf("%s (%d)", mibps(v), t.msgs[pathSocat]), fmt.Sprintf("%.2f", v/t.bps[pathDirect])
		}
		_, _ = fmt.Fprintf(tw, "%s %s\t%d B\t%s (%d)\t%s (%d)\t%s (%d)\t%s\t%.2f\t%.2f\t%s\t%s\t%s\n", t.direction, t.label, t.messageBytes,
			mibps(t.bps[pathDirect]), t.msgs[pathDirect], mibps(t.bps[pathRelayed]), t.msgs[pathRelayed],
			mibps(t.bps[pathPipe]), t.msgs[pathPipe], socat, ratio, t.bps[pathPipe]/t.bps[pathDirect], socatRatio, target, result)
	}
	_ = tw.Flush()

	m := r.mem
	_, _ = fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "idle relays\tprovider RSS before\tafter\tper relay\tGo heap/relay\tstacks/relay\tgoroutines/relay\ttarget\tresult")
	_, _ = fmt.Fprintf(tw, "%d (provider counts %d; opened in %s)\t%.1f MiB\t%.1f MiB\t%.1f KiB\t%.1f KiB\t%.1f KiB\t%.1f\t≤ 64 KiB\t%s\n",
		m.relays, m.relaysSeenByProvider, m.openedIn.Round(time.Millisecond), float64(m.before.RSSBytes)/(1<<20), float64(m.after.RSSBytes)/(1<<20),
		m.perRelay/1024, m.heapPerRelay/1024, m.stackPerRelay/1024, m.goroutinesPerRelay, verdict(m.perRelay <= 64<<10))
	_ = tw.Flush()
	r.printWakeBreakdown(w)
	if len(r.cycles.failures) > 0 {
		_, _ = fmt.Fprintf(w, "\npause/wake cycles that failed:\n  %s\n", strings.Join(r.cycles.failures, "\n  "))
	}
	r.printRefusals(w)
	_, _ = fmt.Fprintln(w, "\nRound trips: env/getIdle requests of exactly 64 bytes, one at a time, in interleaved blocks on every path.")
	_, _ = fmt.Fprintln(w, "Downloads: fs/readFile answers of the size shown, four in flight. Uploads: notifications of the size shown")
	_, _ = fmt.Fprintln(w, "(read and dropped by the daemon), then one request as a barrier. Requests: requests of the size shown, one at")
	_, _ = fmt.Fprintln(w, "a time, each answered (an error) before the next. Direct is the provider's own GuestDialer")
	_, _ = fmt.Fprintln(w, "connection to the same daemon; the plain pipe is a loopback port in the provider process that copies bytes to")
	_, _ = fmt.Fprintln(w, "the daemon through the same GuestDialer and reads nothing (the floor of any relay). Every path uses the same")
	_, _ = fmt.Fprintln(w, "WebSocket client; message counts in parentheses. socat runs in the guest's network namespace between a port of")
	_, _ = fmt.Fprintln(w, "its loopback and the daemon's (TCP_NODELAY, 64 KiB buffer), reached through the same GuestDialer: two loopback")
	_, _ = fmt.Fprintln(w, "hops and a C copy, the floor the relay is held to. RSS is measured after a full GC.")
}

// ratio is a/b with two decimals, or "–" when b is zero.
func ratio(a, b float64) string {
	if b == 0 {
		return "–"
	}
	return fmt.Sprintf("%.2f×", a/b)
}

func (r *clusterReport) print(w io.Writer) {
	l, rm := r.local, r.remote
	_, _ = fmt.Fprintf(w, "routebench: %s\n\n", r.header)
	_, _ = fmt.Fprintf(w, "local = %s, remote = %s; goals are the remote target's (issue 8)\n\n", r.localLabel, r.remoteLabel)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "measure\tlocal n\tlocal p50\tlocal p95\tremote n\tremote p50\tremote p95\tremote/local (p50)\tgoal (remote)\tresult")
	row := func(name string, ls, rs stats, f func(time.Duration) string, goal, result string) {
		_, _ = fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\n", name, ls.n, f(ls.p50), f(ls.p95), rs.n, f(rs.p50), f(rs.p95),
			ratio(float64(rs.p50), float64(ls.p50)), goal, result)
	}
	ld, rd := r.dials[l], r.dials[rm]
	row("direct dial (GuestDialer; exec: ExecStream = POST + 4 websockets)", summarize(ld.dial), summarize(rd.dial), ms, "", "")
	row("direct dial → daemon's WebSocket 101 (exec: + nc start)", summarize(ld.upgraded), summarize(rd.upgraded), ms, "", "")
	row(fmt.Sprintf("pause → wake (one dial) → close → setPower paused: %d/%d, %d/%d cycles", l.cycles.completed, l.cycles.asked, rm.cycles.completed, rm.cycles.asked),
		summarize(l.cycles.wakes), summarize(rm.cycles.wakes), ms, "all cycles complete", verdict(rm.cycles.asked > 0 && rm.cycles.completed == rm.cycles.asked))
	for i := range min(len(l.wakes), len(rm.wakes)) {
		lw, rw := l.wakes[i], rm.wakes[i]
		ls, rs := summarize(lw.latencies), summarize(rw.latencies)
		goal, ok := "p50 ≤ 50 ms", rs.p50 <= 50*time.Millisecond
		if rw.from == controller.PowerStopped {
			goal, ok = "p50 ≤ 500 ms", rs.p50 <= 500*time.Millisecond
		}
		ok = ok && rs.n > 0 && rw.firstOK == len(rw.latencies)+len(rw.refusals)
		row(fmt.Sprintf("%s → upgraded (first dial upgraded %d/%d, %d/%d)", rw.from, lw.firstOK, lw.firstOK+len(lw.refusals), rw.firstOK, rw.firstOK+len(rw.refusals)),
			ls, rs, ms, goal+", first dial upgraded", verdict(ok))
	}
	lr, rr := l.rtt[pathRelayed], rm.rtt[pathRelayed]
	// "≥ 0.9× of the local relay" for a latency: the remote round trip
	// may take at most 1/0.9 of the local one.
	row("round trip, 64-byte messages, relayed", lr, rr, us, "≥ 0.9× local speed (p50 ≤ 1.11× local)", verdict(rr.n > 0 && float64(rr.p50) <= float64(lr.p50)/0.9))
	row("round trip, 64-byte messages, direct", l.rtt[pathDirect], rm.rtt[pathDirect], us, "", "")
	row("round trip, 64-byte messages, plain pipe (floor)", l.rtt[pathPipe], rm.rtt[pathPipe], us, "", "")
	_ = tw.Flush()
	_, _ = fmt.Fprintf(w, "relayed/direct round trip (p50): local %s, remote %s\n", ratio(float64(lr.p50), float64(l.rtt[pathDirect].p50)),
		ratio(float64(rr.p50), float64(rm.rtt[pathDirect].p50)))
	r.printWakeDials(w)

	_, _ = fmt.Fprintln(w)
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "throughput\tlocal direct\tlocal relayed\tremote direct\tremote relayed\tremote pipe\tremote/local relayed\tremote relayed/direct\tgoal\tresult")
	for i := range min(len(l.throughput), len(rm.throughput)) {
		lt, rt := l.throughput[i], rm.throughput[i]
		goal, result := "", ""
		q := rt.bps[pathRelayed] / lt.bps[pathRelayed]
		if rt.label == "1 MiB" {
			goal, result = "≥ 0.9× local relayed", verdict(q >= 0.9)
		}
		_, _ = fmt.Fprintf(tw, "%s %s\t%s\t%s\t%s\t%s\t%s\t%.2f\t%.2f\t%s\t%s\n", rt.direction, rt.label,
			mibps(lt.bps[pathDirect]), mibps(lt.bps[pathRelayed]), mibps(rt.bps[pathDirect]), mibps(rt.bps[pathRelayed]), mibps(rt.bps[pathPipe]),
			q, rt.bps[pathRelayed]/rt.bps[pathDirect], goal, result)
	}
	_ = tw.Flush()

	if r.idleRelays > 0 {
		_, _ = fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		_, _ = fmt.Fprintln(tw, "idle relays\tprovider RSS before\tafter\tper relay\tGo heap/relay\tgoroutines/relay\topened in")
		for _, x := range []struct {
			label string
			m     memResult
		}{{r.localLabel, l.mem}, {r.remoteLabel, rm.mem}} {
			_, _ = fmt.Fprintf(tw, "%d, %s (provider counts %d)\t%.1f MiB\t%.1f MiB\t%.1f KiB\t%.1f KiB\t%.1f\t%s\n", x.m.relays, x.label, x.m.relaysSeenByProvider,
				float64(x.m.before.RSSBytes)/(1<<20), float64(x.m.after.RSSBytes)/(1<<20), x.m.perRelay/1024, x.m.heapPerRelay/1024,
				x.m.goroutinesPerRelay, x.m.openedIn.Round(time.Millisecond))
		}
		_ = tw.Flush()
	}

	c := r.creates
	if c.owners > 0 {
		_, _ = fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		_, _ = fmt.Fprintf(tw, "owners at once, through %s\tn\tp50\tp95\tmax\n", r.createsThrough)
		a := summarize(c.toActive)
		_, _ = fmt.Fprintf(tw, "target/create → active/running, templates round-robin over %s\t%d/%d\t%s\t%s\t%s\n",
			strings.Join(c.templates, ", "), a.n, c.owners, ms(a.p50), ms(a.p95), ms(maxOf(c.toActive)))
		members := make([]string, 0, len(c.byMember))
		for m := range c.byMember {
			members = append(members, m)
		}
		slices.Sort(members)
		for _, m := range members {
			s := summarize(c.byMember[m])
			_, _ = fmt.Fprintf(tw, "  of them on %s\t%d\t%s\t%s\t%s\n", m, s.n, ms(s.p50), ms(s.p95), ms(maxOf(c.byMember[m])))
		}
		cl := summarize(c.toClosed)
		_, _ = fmt.Fprintf(tw, "target/close → closed, all at once\t%d\t%s\t%s\t%s\n", cl.n, ms(cl.p50), ms(cl.p95), ms(maxOf(c.toClosed)))
		_ = tw.Flush()
		_, _ = fmt.Fprintf(w, "creates answered unavailable or busy and asked again after retryAfterMs: %d; the last of %d active %s after the first create\n",
			c.retried, len(c.toActive), c.wall.Round(time.Millisecond))
		if len(c.failures) > 0 {
			_, _ = fmt.Fprintf(w, "create failures:\n  %s\n", strings.Join(c.failures, "\n  "))
		}
	}
	for _, x := range []struct {
		label string
		r     *report
	}{{r.localLabel, l}, {r.remoteLabel, rm}} {
		if len(x.r.cycles.failures) > 0 {
			_, _ = fmt.Fprintf(w, "\n%s: pause/wake cycles that failed:\n  %s\n", x.label, strings.Join(x.r.cycles.failures, "\n  "))
		}
		for _, wk := range x.r.wakes {
			if len(wk.refusals) > 0 {
				_, _ = fmt.Fprintf(w, "\n%s: refused first dials from %s:\n  %s\n", x.label, wk.from, strings.Join(wk.refusals, "\n  "))
			}
		}
	}
	_, _ = fmt.Fprintln(w, "\nAs in single-host mode: round trips are 64-byte env/getIdle requests, downloads fs/readFile answers (four in flight),")
	_, _ = fmt.Fprintln(w, "uploads notifications then a barrier; both targets' paths interleaved. Direct is the benchmark's own GuestDialer")
	_, _ = fmt.Fprintln(w, "connection (member dialer, its own HTTPS connections); the pipe is a byte pipe in the provider through its GuestDialer.")
	_, _ = fmt.Fprintf(w, "create → active is measured through %s.\n", r.createsThrough)
}

func maxOf(d []time.Duration) time.Duration {
	var m time.Duration
	for _, v := range d {
		m = max(m, v)
	}
	return m
}

// printWakeDials says how the provider dialled the guest in each wake:
// the failed dials, then the readiness probe (the first successful dial)
// and the relay (the last), timed from the route dial's start.
func (r *clusterReport) printWakeDials(w io.Writer) {
	_, _ = fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	_, _ = fmt.Fprintln(tw, "wake anatomy, p50 (p95) from the route dial\tn\tfailed dials\tprobe dial at\tprobe dial took\trelay dial at\trelay dial took\trelay dialled → upgraded\tupgraded")
	for _, x := range []struct {
		label string
		r     *report
	}{{r.localLabel, r.local}, {r.remoteLabel, r.remote}} {
		for _, wk := range x.r.wakes {
			var failed, probeAt, probeTook, relayAt, relayTook, tail, up []time.Duration
			for _, d := range wk.dials {
				if len(d.okAt) == 0 {
					continue
				}
				last := len(d.okAt) - 1
				failed = append(failed, time.Duration(d.failed))
				probeAt, probeTook = append(probeAt, d.okAt[0]), append(probeTook, d.okTook[0])
				relayAt, relayTook = append(relayAt, d.okAt[last]), append(relayTook, d.okTook[last])
				tail = append(tail, d.upgraded-d.okAt[last]-d.okTook[last])
				up = append(up, d.upgraded)
			}
			f := summarize(failed)
			pp := func(d []time.Duration) string {
				s := summarize(d)
				return fmt.Sprintf("%s (%s)", ms(s.p50), ms(s.p95))
			}
			_, _ = fmt.Fprintf(tw, "%s, from %s\t%d\t%d (%d)\t%s\t%s\t%s\t%s\t%s\t%s\n", x.label, wk.from, len(up), int64(f.p50), int64(f.p95),
				pp(probeAt), pp(probeTook), pp(relayAt), pp(relayTook), pp(tail), pp(up))
		}
	}
	_ = tw.Flush()
	_, _ = fmt.Fprintln(w, "(the GuestDialer's dials only: for exec, ExecStream; the probe's and the relay's handshakes over them follow each)")
}

func (r *report) printRefusals(w io.Writer) {
	for _, wk := range r.wakes {
		if len(wk.refusals) > 0 {
			_, _ = fmt.Fprintf(w, "\nrefused first dials from %s:\n  %s\n", wk.from, strings.Join(wk.refusals, "\n  "))
		}
	}
}

package incus

import (
	"net/http"
	"net/url"
	"strings"
	"sync"
)

// On a cluster every member's API reaches every instance, but a member
// that does not hold the instance forwards the call to the one that does:
// measured on the rig, an unfreeze through another member took a median
// 100 ms against 69 ms through the holding member, and an exec's
// websockets cross the extra hop for their whole life. So a call about
// one instance goes first to the endpoint of the member that holds it,
// when that endpoint is healthy; the usual order follows it for failover.
//
// The client learns which member holds which instance from the instances
// it reads (their location) and which endpoint is which member from
// ListClusterMembers. Both are hints: a stale one costs the forwarding
// hop, never a wrong answer, since any member answers for any instance.

// maxAffinity bounds the instances remembered; past it the map is
// cleared and learnt again from the next reads.
const maxAffinity = 100_000

type affinity struct {
	mu       sync.Mutex
	where    map[string]string    // project/instance -> member
	byMember map[string]*endpoint // member -> its endpoint
}

func affinityKey(project, name string) string { return project + "/" + name }

// learnMembers maps member names to configured endpoints by host:port.
func (s *endpointSet) learnMembers(members []ClusterMember) {
	if len(s.list) < 2 {
		return
	}
	byHost := map[string]*endpoint{}
	for _, ep := range s.list {
		byHost[strings.ToLower(ep.base.Host)] = ep
	}
	m := map[string]*endpoint{}
	for _, cm := range members {
		u, err := url.Parse(cm.URL)
		if err != nil {
			continue
		}
		if ep, ok := byHost[strings.ToLower(u.Host)]; ok {
			m[cm.ServerName] = ep
		}
	}
	s.aff.mu.Lock()
	s.aff.byMember = m
	s.aff.mu.Unlock()
}

// learnLocation records the member that holds an instance ("" forgets it).
func (s *endpointSet) learnLocation(project, name, member string) {
	if len(s.list) < 2 {
		return
	}
	s.aff.mu.Lock()
	defer s.aff.mu.Unlock()
	if member == "" || member == "none" {
		delete(s.aff.where, affinityKey(project, name))
		return
	}
	if s.aff.where == nil || len(s.aff.where) >= maxAffinity {
		s.aff.where = map[string]string{}
	}
	s.aff.where[affinityKey(project, name)] = member
}

// placement is where a listing said an instance is.
type placement struct{ name, location string }

func placementsOf(list []Instance) []placement {
	out := make([]placement, len(list))
	for i := range list {
		out[i] = placement{list[i].Name, list[i].Location}
	}
	return out
}

// learnList replaces what is known of a project's instances with a full list.
func (s *endpointSet) learnList(project string, list []placement) {
	if len(s.list) < 2 {
		return
	}
	s.aff.mu.Lock()
	defer s.aff.mu.Unlock()
	if s.aff.where == nil || len(s.aff.where)+len(list) > maxAffinity {
		s.aff.where = map[string]string{}
	}
	prefix := project + "/"
	for k := range s.aff.where {
		if strings.HasPrefix(k, prefix) {
			delete(s.aff.where, k)
		}
	}
	for _, p := range list {
		if p.location != "" && p.location != "none" {
			s.aff.where[affinityKey(project, p.name)] = p.location
		}
	}
}

// affineTo is the endpoint a request goes to first, if known: the member
// holding the instance its path names, or, for a create placed on one
// member, that member. A member that is handed a create for another one
// forwards it, and Incus 6.0.4 leaves an event listener open on the
// other member for every create it forwards, for good: each one then
// writes every event of that member to one more listener. Measured on the
// rig, 400 such listeners made a create there 4.7 times as slow (152
// against 32 ms) until the member restarted; creates sent to their own
// member left none. A create Incus places (no target, or a group) is
// forwarded still.
func (s *endpointSet) affineTo(project string, r request) *endpoint {
	if r.method == http.MethodPost && r.path == "/1.0/instances" {
		member := r.query.Get("target")
		if member == "" || strings.HasPrefix(member, "@") || len(s.list) < 2 {
			return nil
		}
		s.aff.mu.Lock()
		defer s.aff.mu.Unlock()
		return s.aff.byMember[member]
	}
	return s.affine(project, r.path)
}

// affine is the endpoint of the member holding the instance a path names,
// if known.
func (s *endpointSet) affine(project, path string) *endpoint {
	if len(s.list) < 2 {
		return nil
	}
	rest, ok := strings.CutPrefix(path, "/1.0/instances/")
	if !ok {
		return nil
	}
	seg, _, _ := strings.Cut(rest, "/")
	name, err := url.PathUnescape(seg)
	if err != nil || name == "" {
		return nil
	}
	s.aff.mu.Lock()
	defer s.aff.mu.Unlock()
	member, ok := s.aff.where[affinityKey(project, name)]
	if !ok {
		return nil
	}
	return s.aff.byMember[member]
}

// preferAffine moves the pick of ep to the front if it is there as a
// healthy endpoint or a probe; one cooling down keeps its place.
func preferAffine(picks []pick, ep *endpoint) []pick {
	if ep == nil {
		return picks
	}
	for i, p := range picks {
		if p.ep != ep {
			continue
		}
		p.ep.mu.Lock()
		usable := p.probe || p.ep.failures == 0
		p.ep.mu.Unlock()
		if !usable || i == 0 {
			return picks
		}
		copy(picks[1:i+1], picks[:i])
		picks[0] = p
		return picks
	}
	return picks
}

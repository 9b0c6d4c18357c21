package guest

import (
	"errors"
	"fmt"
	"sync/atomic"
)

// PeerSecrets are the forwarding secrets a replica holds: the first is the
// one it proves itself with, and a peer's proof with any of them is
// accepted. Holding two lets the replicas rotate the secret without a
// moment in which two of them disagree: each first accepts the new one
// beside the old (old first), then proves itself with it (new first),
// then drops the old; at every step any two replicas still understand
// each other. Set replaces them at once, for the next connection; those
// open keep the proof they made.
type PeerSecrets struct {
	set atomic.Pointer[[][]byte]
}

// NewPeerSecrets holds secrets (see Set).
func NewPeerSecrets(secrets [][]byte) (*PeerSecrets, error) {
	p := &PeerSecrets{}
	if err := p.Set(secrets); err != nil {
		return nil, err
	}
	return p, nil
}

// Set makes secrets the ones in force: one or two, each at least
// MinForwardSecret bytes. A refused set leaves the ones in force.
func (p *PeerSecrets) Set(secrets [][]byte) error {
	if len(secrets) == 0 || len(secrets) > 2 {
		return fmt.Errorf("guest: %d forwarding secrets: hold one, or two while rotating", len(secrets))
	}
	held := make([][]byte, len(secrets))
	for i, s := range secrets {
		if len(s) < MinForwardSecret {
			return fmt.Errorf("guest: forwarding secret %d has %d bytes; it needs at least %d", i+1, len(s), MinForwardSecret)
		}
		held[i] = append([]byte(nil), s...)
	}
	p.set.Store(&held)
	return nil
}

// proving is the secret this replica proves itself with.
func (p *PeerSecrets) proving() []byte { return (*p.set.Load())[0] }

// accepted are the secrets a peer's proof may be made with.
func (p *PeerSecrets) accepted() [][]byte { return *p.set.Load() }

// secretsOf is the PeerSecrets a set of options names: its own, or one
// holding the single secret given.
func secretsOf(held *PeerSecrets, single []byte) (*PeerSecrets, error) {
	if held != nil {
		return held, nil
	}
	if single == nil {
		return nil, errors.New("guest: forwarding needs the replicas' shared secret")
	}
	return NewPeerSecrets([][]byte{single})
}

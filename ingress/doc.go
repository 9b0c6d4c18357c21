// Package ingress is the public ingress edge: an HTTP listener of its own
// that maps each request's Host, through the label the targets hand out,
// to a routed target (from memory, no Incus call), wakes a powered-down
// target through its one wake (package wake, shared with the data routes'
// dials), and reverse-proxies the request to the template's ingress port
// over the provider's GuestDialer, so no guest network is ever exposed.
// Every upstream connection is entered in the relay registry like a
// data-route relay: the idle loop never powers a target down under one,
// and an explicit power-down closes them first.
package ingress
